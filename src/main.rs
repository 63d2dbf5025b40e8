//! The `policyd` binary's command line: serve (the default), check a config, print the
//! embedded one, or benchmark a server (through the `policyd-bench` binary). Everything it
//! runs lives in the library.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};

use policyd::app::AppError;
use policyd::config::{Config, ConfigError};
use policyd::policy::build::PolicyError;
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
    use policyd::log_limit::Escaped;
    use std::io::Write;
    // Every line's control characters are escaped here, whatever a call site forgot: a client's
    // string cannot end a line and forge the next (with journald, a `<0>` emergency).
    if journal {
        // sd-daemon(3) priority prefixes, which journald turns into the entry's priority.
        b.format(|f, r| {
            let prio = match r.level() {
                log::Level::Error => 3,
                log::Level::Warn => 4,
                log::Level::Info => 6,
                log::Level::Debug | log::Level::Trace => 7,
            };
            writeln!(f, "<{prio}>{}: {}", r.target(), Escaped(r.args()))
        });
    } else {
        b.format(|f, r| {
            writeln!(
                f,
                "[{} {:<5} {}] {}",
                f.timestamp(),
                r.level(),
                r.target(),
                Escaped(r.args())
            )
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
    /// Tokenize prompts as an `[inputs.tokenizer]` binding does, to check a tokenizer file
    /// against openpi's: JSON lines in (`{"prompt": "…", "state": [normalised values]}`), JSON
    /// lines out (`{"ids": […], "mask": […], "tokens": untruncated count}`).
    Tokenize {
        /// The SentencePiece `.model` or `tokenizer.json`.
        #[arg(long)]
        tokenizer: PathBuf,
        /// `pi0`, `pi05`, `plain` or `lerobot`.
        #[arg(long, default_value = "pi0")]
        format: String,
        #[arg(long, default_value_t = 48)]
        max_tokens: usize,
        #[arg(long, default_value_t = 0)]
        pad_id: i64,
        /// A tokenizer.json's BOS token.
        #[arg(long)]
        bos: Option<String>,
    },
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
fn run_bench(
    leading: &[&str],
    config: Option<&PathBuf>,
    args: &[OsString],
) -> Result<(), CliError> {
    let program = match std::env::var_os("POLICYD_BENCH") {
        Some(p) => PathBuf::from(p),
        None => std::env::current_exe()
            .ok()
            .map(|e| e.with_file_name("policyd-bench"))
            .filter(|p| p.is_file())
            .unwrap_or_else(|| PathBuf::from("policyd-bench")),
    };
    // Checked here, not left to the spawn: under an emulator (qemu-user) a failed exec shows
    // only as the child's exit status 127.
    let has_dir = program.parent().is_some_and(|d| !d.as_os_str().is_empty());
    if has_dir && !program.is_file() {
        return Err(CliError::Bench {
            program: program.display().to_string(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
        });
    }
    let mut cmd = std::process::Command::new(&program);
    cmd.args(leading);
    if let Some(c) = config {
        cmd.arg("--config").arg(c);
    }
    let status = cmd.args(args).status().map_err(|source| CliError::Bench {
        program: program.display().to_string(),
        source,
    })?;
    match status.code() {
        Some(0) => Ok(()),
        // policyd-bench printed its own error.
        Some(code) => std::process::exit(code),
        None => Err(CliError::BenchKilled {
            program: program.display().to_string(),
            status,
        }),
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
) -> Result<Config, ConfigError> {
    let mut cfg = match path {
        Some(p) => Config::load(p)?,
        None => policyd::demo::config()?,
    };
    cfg.override_listen(host, port)?;
    Ok(cfg)
}

/// Why a command failed; printed as `policyd: error: …`, exit status 2.
#[derive(Debug, thiserror::Error)]
enum CliError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error(transparent)]
    App(#[from] AppError),
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
    /// `policyd bench`: policyd-bench could not be run.
    #[error(
        "cannot run {program}: {source} (the load generator is the policyd-bench binary: install it beside policyd, or build it with `cargo build --release -p policyd-bench`)"
    )]
    Bench {
        program: String,
        source: std::io::Error,
    },
    #[error("tokenize: {0}")]
    Tokenize(String),
    #[error("{program} was killed ({status})")]
    BenchKilled {
        program: String,
        status: std::process::ExitStatus,
    },
}

fn run(cli: Cli) -> Result<(), CliError> {
    let (host, port) = (cli.host.clone(), cli.port);
    match &cli.command {
        Some(Command::PrintDefaultConfig) => {
            print!("{}", policyd::demo::config_text());
            Ok(())
        }
        Some(Command::CheckConfig { file }) => {
            let cfg = load_config(Some(file), host.as_deref(), port)?;
            // Fails as serving would: key files and the certificate are read too.
            policyd::net::Access::load(&cfg)?;
            let report = policyd::policy::build::check(&cfg, &file.display().to_string())?;
            print!("{report}");
            Ok(())
        }
        Some(Command::Tokenize {
            tokenizer,
            format,
            max_tokens,
            pad_id,
            bos,
        }) => tokenize(tokenizer, format, *max_tokens, *pad_id, bos.as_deref()),
        Some(Command::Bench { args }) => run_bench(&[], cli.config.as_ref(), args),
        Some(Command::BenchFloor { args }) => run_bench(&["floor"], None, args),
        Some(Command::Serve) | None => {
            let cfg = load_config(cli.config.as_ref(), host.as_deref(), port)?;
            // A reload re-reads the same file with the same command-line overrides.
            let reload = cli.config.clone().map(|p| {
                let load = move || load_config(Some(&p), host.as_deref(), port);
                Arc::new(load) as Arc<dyn Fn() -> Result<Config, ConfigError> + Send + Sync>
            });
            serve(cfg, reload)
        }
    }
}

/// `policyd tokenize`: stdin's prompts through the tokenizer, padded and cut as a binding does.
fn tokenize(
    file: &PathBuf,
    format: &str,
    max_tokens: usize,
    pad_id: i64,
    bos: Option<&str>,
) -> Result<(), CliError> {
    use policyd::tokenizer::{Around, Format, Tokenizer, state_bin};
    use std::io::{BufRead, Write};
    let usage = |m: String| CliError::Tokenize(m);
    let format = Format::from_name(format).ok_or_else(|| {
        usage(format!(
            "--format must be pi0, pi05, plain, lerobot, groot or groot_raw (the last two without their template ids), got {format}"
        ))
    })?;
    let bytes =
        std::fs::read(file).map_err(|e| usage(format!("cannot read {}: {e}", file.display())))?;
    let tok =
        Tokenizer::load(&bytes, bos).map_err(|e| usage(format!("{}: {e}", file.display())))?;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let mut ids = Vec::new();
    for (n, line) in std::io::stdin().lock().lines().enumerate() {
        let line = line.map_err(|e| usage(format!("stdin: {e}")))?;
        let bad = |m: &str| usage(format!("line {}: {m}", n + 1));
        let v: serde_json::Value = serde_json::from_str(&line).map_err(|e| bad(&e.to_string()))?;
        let prompt = v["prompt"]
            .as_str()
            .ok_or_else(|| bad("no \"prompt\" string"))?;
        let bins: Vec<i16> = match v.get("state").and_then(|s| s.as_array()) {
            Some(s) => s
                .iter()
                .map(|x| state_bin(x.as_f64().unwrap_or(f64::NAN)))
                .collect(),
            None => Vec::new(),
        };
        tok.tokenize(format, prompt, &bins, Around::NONE, &mut ids)
            .map_err(|e| bad(&e.to_string()))?;
        let padded: Vec<i64> = (0..max_tokens)
            .map(|k| ids.get(k).map_or(pad_id, |&i| i64::from(i)))
            .collect();
        let mask: Vec<bool> = (0..max_tokens).map(|k| k < ids.len()).collect();
        let line = serde_json::json!({"ids": padded, "mask": mask, "tokens": ids.len()});
        writeln!(out, "{line}").map_err(|e| usage(format!("stdout: {e}")))?;
    }
    out.flush().map_err(|e| usage(format!("stdout: {e}")))?;
    Ok(())
}

fn serve(
    cfg: Config,
    reload: Option<Arc<dyn Fn() -> Result<Config, ConfigError> + Send + Sync>>,
) -> Result<(), CliError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    rt.block_on(async {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(reload_signal(tx, reload.is_some()));
        let source = reload.map(|load| Reloader { load, requests: rx });
        policyd::app::run_with_reload(cfg, policyd::engine::open, shutdown_signal(), source)
            .await
            .map_err(CliError::from)
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

/// The first `SIGINT` or `SIGTERM` starts a graceful shutdown: no new connections, in-flight
/// requests answered, connections closed with 1001 (up to 10 s). A second one while that runs
/// means the operator will not wait (Ctrl-C twice): exit at once, 128 + the signal's number.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut int), Ok(mut term)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            let _ = tokio::signal::ctrl_c().await;
            return;
        };
        let first = tokio::select! {
            _ = int.recv() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        };
        log::info!("{first} received: shutting down gracefully (a second signal exits at once)");
        tokio::spawn(async move {
            let (name, code) = tokio::select! {
                _ = int.recv() => ("SIGINT", 128 + libc::SIGINT),
                _ = term.recv() => ("SIGTERM", 128 + libc::SIGTERM),
            };
            log::warn!("second signal ({name}): exiting now, without finishing the shutdown");
            std::process::exit(code);
        });
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
