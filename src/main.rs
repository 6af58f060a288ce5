//! The `backstop` command line: thin wrappers over the library.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode};

use backstop::{config::Config, server, telemetry};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "backstop", version, about = "A reverse proxy that keeps AI agent failures cheap")]
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
    /// Run the fault-injecting mock upstream alone.
    MockUpstream {
        #[arg(long, default_value = "127.0.0.1:9090")]
        listen: SocketAddr,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::CheckConfig { config } => match Config::load(&config) {
            Ok(c) => {
                println!(
                    "{}: ok ({} upstreams, {} routes, {} tenants)",
                    config.display(),
                    c.upstreams.len(),
                    c.routes.len(),
                    c.tenants.len()
                );
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
            runtime().block_on(async move {
                let handle = match server::spawn(config).await {
                    Ok(h) => h,
                    Err(err) => {
                        tracing::error!(error = %err, "cannot start");
                        return ExitCode::FAILURE;
                    }
                };
                server::shutdown_signal().await;
                handle.shutdown().await;
                tracing::info!("stopped");
                ExitCode::SUCCESS
            })
        }
        Command::MockUpstream { listen } => {
            telemetry::init_logging(&Default::default());
            runtime().block_on(async move {
                tokio::select! {
                    result = backstop::mock::run(listen) => {
                        let Err(err) = result;
                        eprintln!("mock upstream: {err}");
                        ExitCode::FAILURE
                    }
                    () = server::shutdown_signal() => ExitCode::SUCCESS,
                }
            })
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime starts")
}
