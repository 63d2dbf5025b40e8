//! The `policyd-bench` command line (also reached as `policyd bench` and `policyd bench-floor`,
//! which run it): measure a server, or serve the transport floor that `--floor` starts.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use policyd::config::Config;
use policyd_bench::BenchArgs;

/// Measure an OpenPI-protocol server (policyd or another): latency percentiles, throughput,
/// server CPU per request; against a second server or the transport floor (see
/// docs/benchmarks.md).
#[derive(Parser, Debug)]
#[command(version, about, args_conflicts_with_subcommands = true)]
struct Cli {
    /// A policyd config file: its default policy's [[inputs]] are sent instead of a profile.
    #[arg(long)]
    config: Option<PathBuf>,
    #[command(flatten)]
    bench: BenchArgs,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the transport floor: a WebSocket endpoint that answers every frame with a fixed
    /// reply without decoding it (what `--floor` starts).
    Floor {
        /// Address to listen on (port 0: any free port; the bound address is printed).
        #[arg(long, default_value = "127.0.0.1:8100")]
        listen: std::net::SocketAddr,
        /// Shape of the float32 `actions` array in the reply, e.g. 50x14.
        #[arg(long, default_value = "50x14")]
        actions: String,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("policyd-bench: error: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> Result<(), String> {
    if let Some(Command::Floor { listen, actions }) = &cli.command {
        let shape: Vec<usize> = actions
            .split('x')
            .map(|d| d.trim().parse::<usize>())
            .collect::<Result<_, _>>()
            .ok()
            .filter(|s: &Vec<usize>| !s.is_empty() && s.iter().all(|&d| d > 0 && d < 1 << 16))
            .ok_or_else(|| format!("--actions '{actions}': expected dimensions like 50x14"))?;
        return policyd_bench::floor::run(*listen, &shape);
    }
    let cfg = match &cli.config {
        Some(p) => Some(Config::load(p).map_err(|e| e.to_string())?),
        None => None,
    };
    // `--floor` runs this same binary's `floor`.
    let exe = std::env::current_exe()
        .map_err(|e| format!("cannot find the policyd-bench binary for --floor: {e}"))?;
    let args = &cli.bench;
    let report = policyd_bench::run(args, cfg.as_ref(), &[exe.into_os_string()])
        .map_err(|e| e.to_string())?;
    if args.json {
        println!("{}", report.json());
    } else {
        print!("{}", report.text());
    }
    Ok(())
}
