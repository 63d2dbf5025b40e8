//! The `policyd` binary's command line: serve (the default), check a config, print the
//! embedded one, or benchmark a server (through the `policyd-bench` binary). Everything it
//! runs lives in the library.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};

use policyd::config::Config;
use policyd::policy::build::open_engine;
use policyd::policy::reload::Reloader;

/// A robot-policy inference server speaking the OpenPI WebSocket protocol.
///
/// With no arguments it serves the embedded demo policy (ALOHA profile, CPU engine) on
/// 127.0.0.1:8000.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// Config file (TOML); without it the embedded demo config is served.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// Override `server.host`.
    #[arg(long, global = true)]
    host: Option<String>,
    /// Override `server.port`.
    #[arg(long, global = true)]
    port: Option<u16>,
    /// Log lines for the journal (`<priority>message`, journald adds time and unit) or plain
    /// (time, level, module). `auto`: journal when systemd connected stderr to the journal.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Auto)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum LogFormat {
    Auto,
    Journal,
    Plain,
}

/// Logging through `log`: info by default (connections opening and closing, errors, state
/// changes; nothing per request), `RUST_LOG` to change it.
fn init_logging(format: LogFormat) {
    let mut b = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"));
    let journal = match format {
        LogFormat::Journal => true,
        LogFormat::Plain => false,
        LogFormat::Auto => std::env::var_os("JOURNAL_STREAM").is_some(),
    };
    if journal {
        use std::io::Write;
        // sd-daemon(3) priority prefixes, which journald turns into the entry's priority.
        b.format(|f, r| {
            let prio = match r.level() {
                log::Level::Error => 3,
                log::Level::Warn => 4,
                log::Level::Info => 6,
                log::Level::Debug | log::Level::Trace => 7,
            };
            writeln!(f, "<{prio}>{}: {}", r.target(), r.args())
        });
    }
    b.init();
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the policy (the default).
    Serve,
    /// Validate a config against its model and print the memory budget.
    CheckConfig {
        /// The config file to check.
        file: PathBuf,
    },
    /// Print the embedded default config (a starting point for your own).
    PrintDefaultConfig,
    /// Measure an OpenPI-protocol server (policyd or another): latency percentiles, throughput,
    /// server CPU per request; against a second server or the transport floor. Runs
    /// `policyd-bench` (see `policyd-bench --help` and docs/benchmarks.md).
    #[command(disable_help_flag = true)]
    Bench {
        /// Arguments for policyd-bench.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Serve the transport floor (`policyd-bench floor`).
    #[command(disable_help_flag = true)]
    BenchFloor {
        /// Arguments for `policyd-bench floor`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
}

/// Runs the load generator, a separate binary so that the serving one links none of it:
/// `$POLICYD_BENCH`, else the `policyd-bench` beside this binary, else the one on PATH.
fn run_bench(leading: &[&str], config: Option<&PathBuf>, args: &[OsString]) -> Result<(), String> {
    let program = match std::env::var_os("POLICYD_BENCH") {
        Some(p) => PathBuf::from(p),
        None => std::env::current_exe()
            .ok()
            .map(|e| e.with_file_name("policyd-bench"))
            .filter(|p| p.is_file())
            .unwrap_or_else(|| PathBuf::from("policyd-bench")),
    };
    let mut cmd = std::process::Command::new(&program);
    cmd.args(leading);
    if let Some(c) = config {
        cmd.arg("--config").arg(c);
    }
    let status = cmd.args(args).status().map_err(|e| {
        format!(
            "cannot run {}: {e} (the load generator is the policyd-bench binary: install it \
             beside policyd, or build it with `cargo build --release -p policyd-bench`)",
            program.display()
        )
    })?;
    match status.code() {
        Some(0) => Ok(()),
        // policyd-bench printed its own error.
        Some(code) => std::process::exit(code),
        None => Err(format!("{} was killed ({status})", program.display())),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("policyd: error: {e}");
            ExitCode::from(2)
        }
    }
}

/// The config to serve or check: the file, or the embedded demo, with `--host`/`--port` applied
/// (the same overrides on every reload).
fn load_config(
    path: Option<&PathBuf>,
    host: Option<&str>,
    port: Option<u16>,
) -> Result<Config, String> {
    let mut cfg = match path {
        Some(p) => Config::load(p).map_err(|e| e.to_string())?,
        None => policyd::demo::config().map_err(|e| e.to_string())?,
    };
    cfg.override_listen(host, port).map_err(|e| e.to_string())?;
    Ok(cfg)
}

fn run(cli: Cli) -> Result<(), String> {
    let (host, port) = (cli.host.clone(), cli.port);
    match &cli.command {
        Some(Command::PrintDefaultConfig) => {
            print!("{}", policyd::demo::CONFIG);
            Ok(())
        }
        Some(Command::CheckConfig { file }) => {
            let cfg = load_config(Some(file), host.as_deref(), port)?;
            // Fails as serving would: key files and the certificate are read too.
            policyd::net::Access::load(&cfg).map_err(|e| e.to_string())?;
            if cfg.planner.enabled {
                policyd::planner::api_key(&cfg.planner).map_err(|e| e.to_string())?;
            }
            let report = policyd::policy::build::check(&cfg, &file.display().to_string())
                .map_err(|e| e.to_string())?;
            print!("{report}");
            Ok(())
        }
        Some(Command::Bench { args }) => run_bench(&[], cli.config.as_ref(), args),
        Some(Command::BenchFloor { args }) => run_bench(&["floor"], None, args),
        Some(Command::Serve) | None => {
            let cfg = load_config(cli.config.as_ref(), host.as_deref(), port)?;
            // A reload re-reads the same file with the same command-line overrides.
            let reload = cli.config.clone().map(|p| {
                let load = move || load_config(Some(&p), host.as_deref(), port);
                Arc::new(load) as Arc<dyn Fn() -> Result<Config, String> + Send + Sync>
            });
            serve(cfg, reload)
        }
    }
}

fn serve(
    cfg: Config,
    reload: Option<Arc<dyn Fn() -> Result<Config, String> + Send + Sync>>,
) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    rt.block_on(async {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(reload_signal(tx, reload.is_some()));
        let source = reload.map(|load| Reloader { load, requests: rx });
        policyd::app::run_with_reload(cfg, open_engine, shutdown_signal(), source)
            .await
            .map_err(|e| e.to_string())
    })
}

/// `SIGHUP` (`systemctl reload policyd`) asks for a reload of the config file.
async fn reload_signal(tx: tokio::sync::mpsc::Sender<()>, from_file: bool) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let Ok(mut hup) = signal(SignalKind::hangup()) else {
            return;
        };
        while hup.recv().await.is_some() {
            if !from_file {
                log::warn!("SIGHUP: nothing to reload (serving the embedded demo config)");
                continue;
            }
            log::info!("SIGHUP received: reloading the config");
            // A full queue means a reload is already due.
            let _ = tx.try_send(());
        }
    }
    #[cfg(not(unix))]
    {
        let _ = (tx, from_file);
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => log::info!("SIGINT received"),
            _ = term.recv() => log::info!("SIGTERM received"),
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
