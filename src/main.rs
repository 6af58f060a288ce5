//! The `backstop` command line: thin wrappers over the library.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode};

use backstop::{
    clock::Date,
    config::{Config, StoreBackend, MAX_WORKERS},
    report, server, store, telemetry,
};
use clap::{Parser, Subcommand};

/// jemalloc, not glibc's malloc: it gives back to the system what a burst of large
/// request bodies freed (see Cargo.toml and .cargo/config.toml).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(
    name = "backstop",
    version,
    about = "A reverse proxy that keeps AI agent failures cheap"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway.
    Serve {
        #[arg(long, default_value = "config/backstop.toml")]
        config: PathBuf,
    },
    /// Validate a config file and exit (non-zero with the offending key on error).
    CheckConfig {
        #[arg(long, default_value = "config/backstop.toml")]
        config: PathBuf,
    },
    /// Print spend per tenant, UTC day and model from the ledger of the store the config
    /// names (read-only: safe beside a running gateway).
    Report {
        #[arg(long, default_value = "config/backstop.toml")]
        config: PathBuf,
        /// One tenant only.
        #[arg(long)]
        tenant: Option<String>,
        /// First UTC day, inclusive (YYYY-MM-DD).
        #[arg(long)]
        from: Option<Date>,
        /// Last UTC day, inclusive (YYYY-MM-DD).
        #[arg(long)]
        to: Option<Date>,
        /// csv or json.
        #[arg(long, default_value = "csv")]
        format: report::Format,
    },
    /// Print what a model costs per token kind and where each price came from (the
    /// built-in catalog and its date, or a `[[prices]]` entry); without a model, every
    /// model the routes may call.
    Prices {
        #[arg(long, default_value = "config/backstop.toml")]
        config: PathBuf,
        /// The model id as the upstream is asked for it.
        model: Option<String>,
    },
    /// Run the fault-injecting mock upstream alone.
    MockUpstream {
        #[arg(long, default_value = "127.0.0.1:9090")]
        listen: SocketAddr,
        /// Random faults for unscripted requests, e.g. "status=503@0.2|reset@0.05".
        #[arg(long, default_value = "")]
        fault_mix: String,
        /// Refuse what the real APIs refuse (unknown fields, empty text blocks, orphan
        /// tool results, ...), as they would; a request's `x-mock-strict: off` opts out.
        #[arg(long)]
        strict: bool,
        /// Threads running its async runtime (default: the cores it may use).
        #[arg(long, value_parser = clap::value_parser!(u16).range(1..=MAX_WORKERS as i64))]
        workers: Option<u16>,
    },
    /// Run a fault storm through Backstop against the mock and print what happened.
    Demo {
        /// Client requests in the storm.
        #[arg(long, default_value_t = 1000)]
        requests: usize,
        /// Concurrent clients.
        #[arg(long, default_value_t = 32)]
        concurrency: usize,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::CheckConfig { config } => match Config::load(&config) {
            Ok(c) => {
                for (old, new) in &c.deprecated {
                    eprintln!("{}: {old} is deprecated: use {new}", config.display());
                }
                println!(
                    "{}: ok ({} upstreams, {} routes, {} tenants)",
                    config.display(),
                    c.upstreams.len(),
                    c.routes.len(),
                    c.tenants.len()
                );
                for note in backstop::prices::notes(&c) {
                    println!("prices: {note}");
                }
                if c.store.backend == StoreBackend::Postgres {
                    // Not connected to: what `serve` would bring the database to.
                    println!(
                        "store: postgres, schema version {} (applied at start, under an advisory lock, to a database behind it)",
                        store::SCHEMA_VERSION
                    );
                    println!(
                        "store: writes postgres cannot take are spooled to {}",
                        c.store.spool_path()
                    );
                }
                ExitCode::SUCCESS
            }
            Err(err) => {
                eprintln!("{}: {err}", config.display());
                ExitCode::from(2)
            }
        },
        Command::Serve { config } => {
            let config = match Config::load(&config) {
                Ok(c) => c,
                Err(err) => {
                    eprintln!("{}: {err}", config.display());
                    return ExitCode::from(2);
                }
            };
            telemetry::init_logging(&config.log);
            // Said again: at load, no log was set up yet.
            config.warn_deprecated();
            let code = runtime(config.server.workers).block_on(async move {
                let handle = match server::spawn(config).await {
                    Ok(h) => h,
                    Err(err) => {
                        tracing::error!(error = %err, "cannot start");
                        return ExitCode::FAILURE;
                    }
                };
                server::reload_on_sighup(&handle);
                server::shutdown_signal().await;
                handle.shutdown().await;
                tracing::info!("stopped");
                ExitCode::SUCCESS
            });
            telemetry::flush_logs();
            code
        }
        Command::Report {
            config,
            tenant,
            from,
            to,
            format,
        } => {
            let loaded = match Config::load(&config) {
                Ok(c) => c,
                Err(err) => {
                    eprintln!("{}: {err}", config.display());
                    return ExitCode::from(2);
                }
            };
            let args = report::Args {
                tenant,
                from,
                to,
                format,
            };
            match runtime(None).block_on(report::run(&loaded, &args)) {
                Ok(text) => {
                    use std::io::Write;
                    let mut out = std::io::stdout().lock();
                    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
                        // Piped into `head`: what was wanted was printed.
                        Err(err) if err.kind() != std::io::ErrorKind::BrokenPipe => {
                            eprintln!("backstop report: {err}");
                            ExitCode::FAILURE
                        }
                        _ => ExitCode::SUCCESS,
                    }
                }
                Err(err) => {
                    eprintln!("backstop report: {err}");
                    ExitCode::from(err.exit_code())
                }
            }
        }
        Command::Prices { config, model } => {
            let loaded = match Config::load(&config) {
                Ok(c) => c,
                Err(err) => {
                    eprintln!("{}: {err}", config.display());
                    return ExitCode::from(2);
                }
            };
            match backstop::prices::show(&loaded, model.as_deref()) {
                Ok(text) => {
                    print!("{text}");
                    ExitCode::SUCCESS
                }
                Err(err) => {
                    eprintln!("backstop prices: {err}");
                    ExitCode::from(1)
                }
            }
        }
        Command::Demo {
            requests,
            concurrency,
        } => {
            runtime(None).block_on(backstop::demo::run(requests, concurrency));
            ExitCode::SUCCESS
        }
        Command::MockUpstream {
            listen,
            fault_mix,
            strict,
            workers,
        } => {
            let mix = match backstop::mock::FaultMix::parse(&fault_mix) {
                Ok(mix) => mix,
                Err(err) => {
                    eprintln!("--fault-mix: {err}");
                    return ExitCode::from(2);
                }
            };
            telemetry::init_logging(&Default::default());
            let code = runtime(workers.map(usize::from)).block_on(async move {
                tokio::select! {
                    result = backstop::mock::run(listen, backstop::mock::MockConfig { mix, seed: None, strict }) => {
                        let Err(err) = result;
                        eprintln!("mock upstream: {err}");
                        ExitCode::FAILURE
                    }
                    () = server::shutdown_signal() => ExitCode::SUCCESS,
                }
            });
            telemetry::flush_logs();
            code
        }
    }
}

/// The multi-threaded runtime, with `workers` threads (`server.workers`) or, unset,
/// tokio's default: the cores this process may use.
fn runtime(workers: Option<usize>) -> tokio::runtime::Runtime {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(workers) = workers {
        builder.worker_threads(workers);
    }
    builder.enable_all().build().expect("tokio runtime starts")
}
