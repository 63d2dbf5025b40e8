//! The figures of a benchmark run, as a table for people or JSON for scripts, with the ratio
//! of each figure between the first target and every other (measured in turn, in one run, so
//! a noisy machine still compares fairly).

use serde::Serialize;

use super::load::Outcome;

/// Latency percentiles in milliseconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p99_9: f64,
    pub max: f64,
    pub mean: f64,
}

/// One target's figures over all its measured windows.
#[derive(Clone, Debug, Serialize)]
pub struct Figures {
    pub name: String,
    pub url: String,
    /// The server process whose CPU time was read, when known.
    pub pid: Option<u32>,
    pub requests: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    pub throughput_rps: f64,
    pub latency_ms: Latency,
    /// Replies later than the budget (`--budget-ms`).
    pub misses: Option<u64>,
    /// Open loop: requests never sent because the server fell behind the rate.
    pub unsent: Option<u64>,
    /// Mean of the replies' `policy_timing.infer_ms`: engine time.
    pub engine_ms_per_request: Option<f64>,
    /// Server CPU time (user + system, all threads) per request.
    pub cpu_ms_per_request: Option<f64>,
    /// Server CPU per request minus engine time: what serving itself costs.
    pub serving_cpu_ms_per_request: Option<f64>,
}

impl Figures {
    pub fn new(name: &str, url: &str, pid: Option<u32>, o: &Outcome, cpu_s: Option<f64>) -> Self {
        let h = &o.hist;
        let requests = h.len();
        let q = |p: f64| h.value_at_quantile(p) as f64 / 1000.0;
        let per_req = |x: f64| (requests > 0).then(|| x / requests as f64);
        let engine = (o.engine_replies > 0).then(|| o.engine_ms / o.engine_replies as f64);
        let cpu = cpu_s.and_then(|s| per_req(s * 1000.0));
        let window = o.window.as_secs_f64();
        Figures {
            name: name.to_string(),
            url: url.to_string(),
            pid,
            requests,
            errors: o.errors,
            first_error: o.first_error.clone(),
            throughput_rps: if window > 0.0 {
                requests as f64 / window
            } else {
                0.0
            },
            latency_ms: if requests == 0 {
                Latency::default()
            } else {
                Latency {
                    p50: q(0.5),
                    p90: q(0.9),
                    p99: q(0.99),
                    p99_9: q(0.999),
                    max: h.max() as f64 / 1000.0,
                    mean: h.mean() / 1000.0,
                }
            },
            misses: None,
            unsent: None,
            engine_ms_per_request: engine,
            cpu_ms_per_request: cpu,
            serving_cpu_ms_per_request: cpu.map(|c| (c - engine.unwrap_or(0.0)).max(0.0)),
        }
    }

    /// The figures that have a ratio, by name.
    fn comparable(&self) -> Vec<(&'static str, Option<f64>)> {
        let l = &self.latency_ms;
        vec![
            ("throughput_rps", Some(self.throughput_rps)),
            ("p50_ms", Some(l.p50)),
            ("p90_ms", Some(l.p90)),
            ("p99_ms", Some(l.p99)),
            ("p99_9_ms", Some(l.p99_9)),
            ("max_ms", Some(l.max)),
            ("mean_ms", Some(l.mean)),
            ("cpu_ms_per_request", self.cpu_ms_per_request),
            (
                "serving_cpu_ms_per_request",
                self.serving_cpu_ms_per_request,
            ),
        ]
    }
}

/// The first target's figures divided by another's.
#[derive(Clone, Debug, Serialize)]
pub struct Ratio {
    /// `"<first> / <other>"`.
    pub pair: String,
    pub figures: Vec<(String, f64)>,
}

/// How the run was made.
#[derive(Clone, Debug, Serialize)]
pub struct RunInfo {
    pub profile: String,
    pub arrays: String,
    pub frame_bytes: usize,
    pub connections: usize,
    /// `closed` or `open`.
    pub mode: String,
    pub rate_hz_per_connection: Option<f64>,
    /// Open loop: the connections send together each period instead of spread over it.
    pub burst: bool,
    pub warmup_s: f64,
    pub duration_s: f64,
    pub rounds: usize,
    pub budget_ms: Option<f64>,
}

/// A whole run.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub run: RunInfo,
    pub targets: Vec<Figures>,
    pub ratios: Vec<Ratio>,
}

impl Report {
    pub fn new(run: RunInfo, targets: Vec<Figures>) -> Report {
        let mut ratios = Vec::new();
        if let Some((a, rest)) = targets.split_first() {
            for b in rest {
                let figures = a
                    .comparable()
                    .into_iter()
                    .zip(b.comparable())
                    .filter_map(|((k, x), (_, y))| match (x, y) {
                        (Some(x), Some(y)) if y > 0.0 => Some((k.to_string(), x / y)),
                        _ => None,
                    })
                    .collect();
                ratios.push(Ratio {
                    pair: format!("{} / {}", a.name, b.name),
                    figures,
                });
            }
        }
        Report {
            run,
            targets,
            ratios,
        }
    }

    pub fn json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }

    /// A table: one row per figure, one column per target, then one per ratio.
    pub fn text(&self) -> String {
        let r = &self.run;
        let mode = match r.rate_hz_per_connection {
            Some(hz) => {
                format!("open loop at {hz} Hz per connection (latency from the intended send time)")
            }
            None => "closed loop (back to back)".to_string(),
        };
        let mut s = format!(
            "profile {} ({} B per request: {})\n{} connection(s), {mode}\n{} s measured after {} s warm-up{}\n\n",
            r.profile,
            r.frame_bytes,
            r.arrays,
            r.connections,
            r.duration_s,
            r.warmup_s,
            if r.rounds > 1 {
                format!(", in {} rounds taking the targets in turn", r.rounds)
            } else {
                String::new()
            }
        );
        for t in &self.targets {
            s += &format!(
                "{}: {}{}\n",
                t.name,
                t.url,
                t.pid.map(|p| format!(" (pid {p})")).unwrap_or_default()
            );
        }
        s.push('\n');
        let w = 16;
        let mut header = format!("{:<28}", "");
        for t in &self.targets {
            header += &format!("{:>w$}", t.name);
        }
        for q in &self.ratios {
            header += &format!("{:>w$}", q.pair.replace(' ', ""));
        }
        s += header.trim_end();
        s.push('\n');
        let row = |label: &str, vals: Vec<Option<String>>, key: Option<&str>| {
            let mut line = format!("{label:<28}");
            for v in vals {
                line += &format!("{:>w$}", v.unwrap_or_else(|| "-".into()));
            }
            if let Some(k) = key {
                for q in &self.ratios {
                    let v = q.figures.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
                    line += &format!(
                        "{:>w$}",
                        v.map(|v| format!("{v:.2}x")).unwrap_or("-".into())
                    );
                }
            }
            line.trim_end().to_string() + "\n"
        };
        let f = |g: &dyn Fn(&Figures) -> Option<f64>, prec: usize| -> Vec<Option<String>> {
            self.targets
                .iter()
                .map(|t| g(t).map(|v| format!("{v:.prec$}")))
                .collect()
        };
        s += &row("requests", f(&|t| Some(t.requests as f64), 0), None);
        s += &row("errors", f(&|t| Some(t.errors as f64), 0), None);
        s += &row(
            "throughput (req/s)",
            f(&|t| Some(t.throughput_rps), 1),
            Some("throughput_rps"),
        );
        for (label, key, g) in [
            (
                "latency p50 (ms)",
                "p50_ms",
                (|l: &Latency| l.p50) as fn(&Latency) -> f64,
            ),
            ("latency p90 (ms)", "p90_ms", |l| l.p90),
            ("latency p99 (ms)", "p99_ms", |l| l.p99),
            ("latency p99.9 (ms)", "p99_9_ms", |l| l.p99_9),
            ("latency max (ms)", "max_ms", |l| l.max),
            ("latency mean (ms)", "mean_ms", |l| l.mean),
        ] {
            s += &row(label, f(&|t| Some(g(&t.latency_ms)), 3), Some(key));
        }
        if let Some(b) = r.budget_ms {
            s += &row(
                &format!("misses (> {b} ms)"),
                f(&|t| t.misses.map(|m| m as f64), 0),
                None,
            );
        }
        if r.rate_hz_per_connection.is_some() {
            s += &row(
                "unsent (server behind)",
                f(&|t| t.unsent.map(|m| m as f64), 0),
                None,
            );
        }
        s += &row("engine (ms/req)", f(&|t| t.engine_ms_per_request, 3), None);
        s += &row(
            "server CPU (ms/req)",
            f(&|t| t.cpu_ms_per_request, 3),
            Some("cpu_ms_per_request"),
        );
        s += &row(
            "serving CPU (ms/req)",
            f(&|t| t.serving_cpu_ms_per_request, 3),
            Some("serving_cpu_ms_per_request"),
        );
        for t in &self.targets {
            if let Some(e) = &t.first_error {
                s += &format!("\n{}: {} error(s), the first: {e}\n", t.name, t.errors);
            }
        }
        if self.targets.iter().any(|t| t.cpu_ms_per_request.is_none()) {
            s += "\nserver CPU needs the server's pid: found by port on this machine, or --pid/--compare-pid\n";
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn outcome(latencies_us: &[u64], engine_ms: f64) -> Outcome {
        let mut o = Outcome::new();
        for &l in latencies_us {
            o.hist.record(l).unwrap();
            o.engine_ms += engine_ms;
            o.engine_replies += 1;
        }
        o.window = Duration::from_secs(2);
        o
    }

    #[test]
    fn figures_and_ratios_follow_the_histograms_and_cpu() {
        let a = outcome(&[1000; 100], 0.4);
        let mut b_lat = vec![500; 99];
        b_lat.push(5000);
        let b = outcome(&b_lat, 0.0);
        let fa = Figures::new("A", "ws://a", Some(1), &a, Some(0.1));
        let fb = Figures::new("B", "ws://b", Some(2), &b, Some(0.02));
        assert_eq!(fa.requests, 100);
        assert!((fa.throughput_rps - 50.0).abs() < 1e-9);
        assert!((fa.latency_ms.p50 - 1.0).abs() < 0.01);
        assert!((fb.latency_ms.p99_9 - 5.0).abs() < 0.01);
        // 100 ms CPU over 100 requests, of which 0.4 ms each is engine.
        assert!((fa.cpu_ms_per_request.unwrap() - 1.0).abs() < 1e-9);
        assert!((fa.serving_cpu_ms_per_request.unwrap() - 0.6).abs() < 1e-9);
        let r = Report::new(
            RunInfo {
                profile: "tiny".into(),
                arrays: String::new(),
                frame_bytes: 1,
                connections: 1,
                mode: "closed".into(),
                rate_hz_per_connection: None,
                burst: false,
                warmup_s: 0.0,
                duration_s: 2.0,
                rounds: 1,
                budget_ms: None,
            },
            vec![fa, fb],
        );
        let ratio = |k: &str| {
            r.ratios[0]
                .figures
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| *v)
                .unwrap()
        };
        assert_eq!(r.ratios[0].pair, "A / B");
        assert!((ratio("p50_ms") - 2.0).abs() < 0.01);
        assert!((ratio("serving_cpu_ms_per_request") - 3.0).abs() < 1e-9);
        let text = r.text();
        assert!(text.contains("2.00x") && text.contains("3.00x"), "{text}");
    }
}
