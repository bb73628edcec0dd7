//! `jobrail`: the operator's command-line tool for jobrail queues.
//!
//! ```text
//! jobrail --backend rabbitmq failed list --queue reports
//! jobrail --backend rabbitmq failed show --queue reports <ID>
//! jobrail --backend rabbitmq failed replay --queue reports <ID>
//! jobrail --backend rabbitmq failed purge --queue reports --older-than 7d
//! jobrail --backend rabbitmq depth --queue reports
//! JOBRAIL_CONFIG=jobs.toml jobrail --backend rabbitmq budget
//! DATABASE_URL=postgres://app@db/shop jobrail --backend postgres install
//! JOBRAIL_CONFIG=jobs.toml jobrail schedules list --claims postgres
//! JOBRAIL_CONFIG=jobs.toml jobrail --backend postgres schedules trigger nightly-digest
//! jobrail --backend postgres --schema jobrail install --print
//! jobrail --backend postgres failed list --queue reports
//! jobrail --backend rabbitmq serve --users users.txt --queue reports --edge edge=https://worker.example
//! ```
//!
//! `jobrail --help` lists the flags and the environment variables read;
//! `--json` prints JSON instead of text.

use std::process::ExitCode;

use clap::Parser;

mod args;
mod backend;
mod budget;
mod commands;
mod error;
mod schedules;
mod serve;

use args::{Cli, Command};
use commands::Output;
use error::CliError;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let json = cli.json;
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => return fail(&CliError::failed(format!("cannot start the runtime: {e}"))),
    };
    match runtime.block_on(run(cli)) {
        Ok(output) => {
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&output.json).unwrap_or_default()
                );
            } else {
                print!("{}", output.text);
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e),
    }
}

fn fail(e: &CliError) -> ExitCode {
    eprintln!("jobrail: {e}");
    ExitCode::from(e.status)
}

async fn run(cli: Cli) -> Result<Output, CliError> {
    match cli.command {
        Command::Budget { jobs } => {
            let overrides = jobrail_native::overrides_from_env()?;
            let mut variables: Vec<String> = std::env::vars_os()
                .filter_map(|(k, _)| k.into_string().ok())
                .filter(|k| k.starts_with("JOBRAIL_JOB__"))
                .collect();
            variables.sort();
            let sources = budget::Sources {
                config_file: std::env::var_os("JOBRAIL_CONFIG")
                    .map(|p| p.to_string_lossy().into_owned()),
                variables,
            };
            let hint = match cli.connection.backend {
                Some(kind) => {
                    let (wait, what) = backend::redelivery_hint(kind);
                    budget::Hint {
                        backend: Some(kind.name()),
                        wait,
                        what,
                    }
                }
                None => budget::Hint {
                    backend: None,
                    wait: std::time::Duration::ZERO,
                    what: "",
                },
            };
            budget::budget(&overrides, &jobs, &sources, &hint)
        }
        Command::Failed(command) => {
            let driver = backend::connect(&cli.connection).await?;
            let result = commands::failed(driver.clone(), command).await;
            stop(driver.as_ref(), result).await
        }
        Command::Install { print } => backend::install(&cli.connection, print).await,
        Command::Schedules(command) => match command {
            args::Schedules::List { source, next, last } => {
                let schedules = schedules::load(&source)?;
                let claims = schedules::claims(&source, &cli.connection).await?;
                Ok(schedules::list(
                    &schedules,
                    claims.as_ref(),
                    jobrail::SystemTime::now(),
                    usize::from(next),
                    usize::from(last),
                )
                .await)
            }
            args::Schedules::Trigger { source, name } => {
                let schedules = schedules::load(&source)?;
                let driver = backend::connect(&cli.connection).await?;
                let result = schedules::trigger(
                    &schedules,
                    &name,
                    driver.clone(),
                    jobrail::SystemTime::now(),
                )
                .await;
                stop(driver.as_ref(), result).await
            }
        },
        Command::Serve(settings) => serve::serve(&cli.connection, settings).await,
        Command::Depth { queue } => {
            let driver = backend::connect(&cli.connection).await?;
            let result = commands::depth(driver.clone(), &queue).await;
            stop(driver.as_ref(), result).await
        }
    }
}

/// Releases the driver; the command's own error wins over one from stopping.
async fn stop(
    driver: &dyn jobrail_native::Driver,
    result: Result<Output, CliError>,
) -> Result<Output, CliError> {
    let stopped = driver.stop().await;
    let output = result?;
    stopped?;
    Ok(output)
}
