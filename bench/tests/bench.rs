//! `policyd-bench` against real servers on loopback: a policyd with a synthetic engine of known
//! compute time, and the transport floor it starts itself. Checks the figures it reports, the
//! open loop's coordinated-omission accounting, the comparison, the JSON and the plot.

use std::time::Duration;

use clap::Parser;
use policyd::config::Config;
use policyd::testing::synthetic::Behaviour;
use policyd_bench::{self as bench, BenchArgs};
use serde_json::Value;

// The servers under test are policyd's own test servers.
#[path = "../../tests/common/mod.rs"]
mod common;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    bench: BenchArgs,
}

fn args(line: &str) -> BenchArgs {
    let argv = std::iter::once("bench").chain(line.split_whitespace());
    Cli::try_parse_from(argv)
        .expect("valid bench arguments")
        .bench
}

/// The command that runs policyd-bench (which `--floor` runs again as `floor`).
fn policyd() -> Vec<std::ffi::OsString> {
    common::command(env!("CARGO_BIN_EXE_policyd-bench"))
}

/// The runs time real requests: one at a time, so they do not load each other's CPU.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A policyd with a synthetic engine taking `compute` per run, served from a runtime of its own
/// (the bench is blocking); returns the runtime (dropping it stops the server), the server's
/// URL and its config.
fn server(compute: Duration) -> (tokio::runtime::Runtime, common::Running, String, Config) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let cfg = common::synthetic_config("", "slots = 4", "");
    let behaviour = Behaviour {
        compute,
        ..Behaviour::default()
    };
    let srv = rt.block_on(common::start(cfg.clone(), behaviour));
    let url = format!("ws://{}", srv.addr);
    (rt, srv, url, cfg)
}

fn report_json(r: &bench::report::Report) -> Value {
    serde_json::from_str(&r.json()).expect("the report is JSON")
}

#[test]
fn closed_loop_against_policyd_and_the_floor_reports_every_figure_and_their_ratios() {
    let _serial = serial();
    let (_rt, _srv, url, cfg) = server(Duration::from_millis(2));
    let plot = std::env::temp_dir().join(format!("policyd-bench-{}.svg", std::process::id()));
    let a = args(&format!(
        "{url} -c 2 --duration 1.2 --warmup 0.3 --rounds 2 --floor --name policyd --plot {}",
        plot.display()
    ));
    let r = bench::run(&a, Some(&cfg), &policyd()).expect("the run succeeds");
    let j = report_json(&r);

    let targets = j["targets"].as_array().expect("targets");
    assert_eq!(targets.len(), 2);
    let (p, f) = (&targets[0], &targets[1]);
    assert_eq!(p["name"], "policyd");
    assert_eq!(f["name"], "floor");
    for t in [p, f] {
        assert!(t["requests"].as_u64().unwrap() > 20, "{t}");
        assert_eq!(t["errors"], 0, "{t}");
        assert!(t["throughput_rps"].as_f64().unwrap() > 10.0, "{t}");
        let l = &t["latency_ms"];
        let v = |k: &str| l[k].as_f64().unwrap();
        assert!(
            v("p50") <= v("p90") && v("p90") <= v("p99") && v("p99") <= v("max"),
            "{l}"
        );
        // Both servers are on this machine: their pids are found by port.
        assert!(t["cpu_ms_per_request"].as_f64().is_some(), "{t}");
    }
    // policyd runs the 2 ms engine on every request; the floor answers at once.
    let engine = p["engine_ms_per_request"].as_f64().unwrap();
    assert!((1.9..4.0).contains(&engine), "engine {engine}");
    assert!(p["latency_ms"]["p50"].as_f64().unwrap() >= 2.0, "{p}");
    assert!(f["latency_ms"]["p50"].as_f64().unwrap() < 2.0, "{f}");
    assert_eq!(f["engine_ms_per_request"].as_f64(), Some(0.0));
    // With 2 connections and 4 slots, throughput is bounded by two 2 ms engines side by side.
    assert!(p["throughput_rps"].as_f64().unwrap() < 1100.0, "{p}");

    let ratios = j["ratios"].as_array().expect("ratios");
    assert_eq!(ratios.len(), 1);
    assert_eq!(ratios[0]["pair"], "policyd / floor");
    let p50 = ratios[0]["figures"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x[0] == "p50_ms")
        .expect("a p50 ratio")[1]
        .as_f64()
        .unwrap();
    let expect =
        p["latency_ms"]["p50"].as_f64().unwrap() / f["latency_ms"]["p50"].as_f64().unwrap();
    assert!(
        (p50 - expect).abs() < 1e-9 && p50 > 1.0,
        "{p50} vs {expect}"
    );

    let text = r.text();
    assert!(
        text.contains("policyd/floor") && text.contains("latency p99.9 (ms)"),
        "{text}"
    );
    let svg = std::fs::read_to_string(&plot).expect("the plot was written");
    let _ = std::fs::remove_file(&plot);
    assert!(svg.starts_with("<svg"), "not an SVG");
    let texts: Vec<&str> = svg.lines().map(str::trim).collect();
    assert!(
        texts.contains(&"policyd") && texts.contains(&"floor"),
        "legend missing"
    );
    assert!(svg.matches("<circle").count() > 40, "too few points");
}

#[test]
fn open_loop_measures_from_the_intended_send_time_so_queueing_shows() {
    let _serial = serial();
    // The server manages 50 requests a second; the open loop asks for 100.
    let (_rt, _srv, url, cfg) = server(Duration::from_millis(20));
    let open = bench::run(
        &args(&format!("{url} --rate 100 --duration 1.5 --warmup 0")),
        Some(&cfg),
        &policyd(),
    )
    .expect("open loop runs");
    let closed = bench::run(
        &args(&format!("{url} --duration 1 --warmup 0")),
        Some(&cfg),
        &policyd(),
    )
    .expect("closed loop runs");
    let (o, c) = (&open.targets[0], &closed.targets[0]);
    // Closed loop: each request takes about the engine's 20 ms.
    assert!(c.latency_ms.p99 < 60.0, "closed p99 {}", c.latency_ms.p99);
    // Open loop: each send is 10 ms later than the last reply allows, so by the end of 1.5 s
    // the schedule is ~0.7 s ahead of the server, and that lag is in the latency.
    assert!(o.latency_ms.max > 400.0, "open max {}", o.latency_ms.max);
    assert!(o.latency_ms.p50 > 150.0, "open p50 {}", o.latency_ms.p50);
    // The default budget is one period (10 ms): every request missed it.
    assert_eq!(open.run.budget_ms, Some(10.0));
    assert_eq!(o.misses, Some(o.requests));
    assert!(
        o.requests < 100,
        "only what the server managed: {}",
        o.requests
    );
}

#[test]
fn open_loop_at_a_rate_the_server_keeps_sends_on_schedule() {
    let _serial = serial();
    let (_rt, _srv, url, cfg) = server(Duration::from_millis(1));
    let r = bench::run(
        &args(&format!(
            "{url} -c 2 --rate 50 --duration 2 --warmup 0.2 --budget-ms 15"
        )),
        Some(&cfg),
        &policyd(),
    )
    .expect("runs");
    let t = &r.targets[0];
    // 2 connections × 50 Hz × 2 s.
    assert!((190..=202).contains(&t.requests), "{} requests", t.requests);
    assert!(
        (90.0..=102.0).contains(&t.throughput_rps),
        "{} req/s",
        t.throughput_rps
    );
    assert_eq!(t.errors, 0);
    assert!(t.latency_ms.p50 < 10.0, "p50 {}", t.latency_ms.p50);
    assert!(t.misses.is_some_and(|m| m < 10), "misses {:?}", t.misses);
}

#[test]
fn open_loop_connections_are_spread_over_the_period_unless_told_to_burst() {
    let _serial = serial();
    // One engine, 10 ms a run; two clients at 25 Hz. Sent together, one of each pair waits
    // for the other's run; spread 20 ms apart, neither waits.
    let (_rt, _srv, url, cfg) = server(Duration::from_millis(10));
    let run = |extra: &str| {
        let line = format!("{url} -c 2 --rate 25 --duration 2 --warmup 0.2 {extra}");
        bench::run(&args(&line), Some(&cfg), &policyd()).expect("runs")
    };
    let spread = run("");
    let burst = run("--burst");
    assert!(burst.run.burst && !spread.run.burst);
    let (s, b) = (&spread.targets[0].latency_ms, &burst.targets[0].latency_ms);
    // Burst: ~20 ms for the second of each pair; spread: ~10 ms, with room for emulation.
    assert!(
        b.p90 > 18.0,
        "bursts queue behind each other: p90 {}",
        b.p90
    );
    assert!(s.p90 < 16.0, "spread requests do not: p90 {}", s.p90);
}

#[test]
fn a_server_that_rejects_the_profile_fails_the_run_with_its_message() {
    let _serial = serial();
    let (_rt, _srv, url, _cfg) = server(Duration::from_millis(1));
    let cmd = policyd();
    let out = std::process::Command::new(&cmd[0])
        .args(&cmd[1..])
        .args([&url, "--profile", "aloha", "--duration", "1"])
        .output()
        .expect("runs policyd-bench");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("'aloha' profile"), "{err}");
    assert!(
        err.contains("state"),
        "the server's message names the missing key: {err}"
    );
    assert!(err.contains("--profile"), "{err}");
}

#[test]
fn bad_arguments_are_refused_before_connecting() {
    let _serial = serial();
    for (line, what) in [
        ("ws://127.0.0.1:9 --connections 0", "--connections"),
        ("ws://127.0.0.1:9 --rate=-1", "--rate"),
        ("ws://127.0.0.1:9 --duration 0", "--duration"),
        ("ws://127.0.0.1:9 --profile franka", "franka"),
        ("http://127.0.0.1:9", "ws://"),
    ] {
        let e = bench::run(&args(line), None, &policyd())
            .err()
            .unwrap_or_else(|| panic!("{line} should fail"))
            .to_string();
        assert!(e.contains(what), "{line}: {e}");
    }
    let e = bench::run(&args("ws://127.0.0.1:9"), None, &policyd())
        .expect_err("nothing listens on port 9")
        .to_string();
    assert!(e.starts_with("cannot connect to ws://127.0.0.1:9"), "{e}");
}
