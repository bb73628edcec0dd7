//! The command line: what the tool accepts.

use std::time::Duration;

use clap::{ArgGroup, Args, Parser, Subcommand, ValueEnum};

/// The RabbitMQ URL when neither `--rabbitmq-url` nor `RABBITMQ_URL` is set
/// (the quick start's).
pub(crate) const DEFAULT_RABBITMQ_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// The NATS URL when neither `--nats-url` nor `NATS_URL` is set.
pub(crate) const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";
/// The Postgres URL when neither `--database-url` nor `DATABASE_URL` is set
/// (the quick start's).
pub(crate) const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
/// The Postgres driver's schema when neither `--schema` nor `JOBRAIL_SCHEMA`
/// is set (`jobrail_postgres::DEFAULT_SCHEMA`).
pub(crate) const DEFAULT_SCHEMA: &str = "jobrail";

const ABOUT: &str =
    "Operate jobrail queues: failure records, queue depths, failure budgets, the Postgres tables";

const LONG_ABOUT: &str = "\
Operate jobrail queues: list, show, replay and purge the failure records a \
worker left, read a queue's depth, compute each job's failure budget from the \
configuration the worker reads, and install the Postgres driver's tables \
(jobrail --backend postgres install).

The backend and its connection come from flags or from the same environment \
variables the worker and the quick start read: JOBRAIL_BACKEND, RABBITMQ_URL, \
NATS_URL, SQS_ENDPOINT and AWS_REGION (SQS credentials from the usual AWS \
variables; with SQS_ENDPOINT, an emulator, fixed test keys), DATABASE_URL and \
JOBRAIL_SCHEMA (Postgres). Failure destinations are found by each driver's \
default naming (Q.failed on RabbitMQ, the failure stream of Q on NATS, \
Q-failed on SQS) unless --failure-queue gives the pattern the worker was \
configured with; on Postgres they are the rows of the schema's `failures` \
table.

Exit status: 0 on success, 1 on an error (an unreachable broker, a refused \
replay...), 2 on a usage error, 3 when a record named is not there.";

/// `jobrail`: the operator's tool.
#[derive(Debug, Parser)]
#[command(name = "jobrail", version, about = ABOUT, long_about = LONG_ABOUT)]
pub(crate) struct Cli {
    /// Which backend, and how to reach it.
    #[command(flatten)]
    pub(crate) connection: Connection,
    /// Print JSON instead of text (one document on standard output).
    #[arg(long, global = true)]
    pub(crate) json: bool,
    /// What to do.
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// The backends the tool knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum BackendKind {
    /// The in-memory queue of this process: empty, for trying the tool.
    Memory,
    /// RabbitMQ (`--rabbitmq-url`, `RABBITMQ_URL`).
    Rabbitmq,
    /// NATS JetStream (`--nats-url`, `NATS_URL`).
    Nats,
    /// Amazon SQS (`--region`, `AWS_REGION`; `--sqs-endpoint`, `SQS_ENDPOINT`).
    Sqs,
    /// Postgres (`--database-url`, `DATABASE_URL`; `--schema`, `JOBRAIL_SCHEMA`).
    Postgres,
}

impl BackendKind {
    /// The name used on the command line and in output.
    pub(crate) fn name(self) -> &'static str {
        match self {
            BackendKind::Memory => "memory",
            BackendKind::Rabbitmq => "rabbitmq",
            BackendKind::Nats => "nats",
            BackendKind::Sqs => "sqs",
            BackendKind::Postgres => "postgres",
        }
    }
}

/// The backend and its connection settings.
#[derive(Debug, Clone, Args)]
pub(crate) struct Connection {
    /// The backend the worker runs on.
    #[arg(long, global = true, env = "JOBRAIL_BACKEND", value_enum)]
    pub(crate) backend: Option<BackendKind>,
    /// The RabbitMQ URL, amqp://user:password@host:port/vhost
    /// [default: amqp://guest:***@127.0.0.1:5672/%2f].
    #[arg(
        long,
        global = true,
        env = "RABBITMQ_URL",
        hide_env_values = true,
        default_value = DEFAULT_RABBITMQ_URL,
        hide_default_value = true
    )]
    pub(crate) rabbitmq_url: String,
    /// The NATS URL [default: nats://127.0.0.1:4222].
    #[arg(
        long,
        global = true,
        env = "NATS_URL",
        hide_env_values = true,
        default_value = DEFAULT_NATS_URL,
        hide_default_value = true
    )]
    pub(crate) nats_url: String,
    /// An SQS endpoint replacing AWS's (an emulator); test keys are used with it.
    #[arg(long, global = true, env = "SQS_ENDPOINT")]
    pub(crate) sqs_endpoint: Option<String>,
    /// The SQS region.
    #[arg(long, global = true, env = "AWS_REGION", default_value = "us-east-1")]
    pub(crate) region: String,
    /// The Postgres URL, postgres://user:password@host:port/database (or
    /// `host=... dbname=...`) [default: postgres://postgres@127.0.0.1:5432/test].
    #[arg(
        long,
        global = true,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = DEFAULT_DATABASE_URL,
        hide_default_value = true
    )]
    pub(crate) database_url: String,
    /// The schema of the Postgres driver's tables.
    #[arg(long, global = true, env = "JOBRAIL_SCHEMA", default_value = DEFAULT_SCHEMA)]
    pub(crate) schema: String,
    /// The failure destination pattern the worker was configured with,
    /// `{queue}` standing for the work queue (RabbitMQ's failure queue,
    /// NATS's failure subject, where `{prefix}` is the subject prefix, SQS's
    /// failure queue; not for Postgres, whose failures are rows of its
    /// schema). Default: each driver's own.
    #[arg(long, global = true, value_name = "PATTERN")]
    pub(crate) failure_queue: Option<String>,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Failure records: list, show, replay, purge.
    #[command(subcommand)]
    Failed(Failed),
    /// How many messages a queue holds (ready, in flight, delayed).
    Depth {
        /// The work queue.
        #[arg(long)]
        queue: String,
    },
    /// Each job's failure budget from the worker's configuration.
    ///
    /// Reads the overrides the worker reads (the TOML file JOBRAIL_CONFIG
    /// names, then JOBRAIL_JOB__<JOB>__<FIELD> variables). The tool does not
    /// have the application's job declarations: each job the file names (and
    /// each --job) is computed from the library's defaults plus the
    /// overrides, so a field the configuration does not set shows the
    /// library's default, which the application's code may have changed.
    /// With --backend, jobs without a backoff count that backend's
    /// redelivery timing (its default setting).
    Budget {
        /// A job to compute besides those the file names (repeatable); needed
        /// for jobs that only JOBRAIL_JOB__ variables override.
        #[arg(long = "job", value_name = "NAME")]
        jobs: Vec<String>,
    },
    /// Postgres only: install or upgrade the driver's tables in the schema.
    ///
    /// Creates the schema (--schema, JOBRAIL_SCHEMA) and its tables, or
    /// upgrades them to this build's version, in one transaction; nothing
    /// changes when they are current. Prints the version found and the
    /// version now. With --print, prints the SQL instead, without
    /// connecting, for a migration tool of your own.
    Install {
        /// Print the SQL that installs the tables on an empty database; connect to nothing.
        #[arg(long)]
        print: bool,
    },
    /// Schedules (recurring jobs): list them with their ticks, trigger one now.
    ///
    /// Reads the `[schedules.<name>]` tables of the configuration file
    /// (--config, or the file JOBRAIL_CONFIG names). The ticks fired are read
    /// from the claim store the workers' schedulers share (--claims).
    #[command(subcommand)]
    Schedules(Schedules),
    /// Serve the dashboard (jobrail-web): queues, jobs, failure records, schedules.
    ///
    /// Shows the queues of --backend (those given with --queue, and those of
    /// the jobs the configuration file names) and each edge worker's failure
    /// keeper given with --edge, side by side. Every page needs a user of the
    /// users file (HTTP Basic): one per line, `NAME ROLE PASSWORD` or
    /// `NAME ROLE sha256:HEX`, ROLE `operator` (replays and purges) or
    /// `read-only`; `#` starts a comment. Each replay and purge is logged
    /// on standard error (target jobrail_web::audit), never a payload.
    Serve(ServeArgs),
}

/// What `jobrail serve` is given.
#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    /// The address to listen on.
    #[arg(long, env = "JOBRAIL_WEB_LISTEN", default_value = "127.0.0.1:8080")]
    pub(crate) listen: String,
    /// The users file.
    #[arg(long, env = "JOBRAIL_WEB_USERS", value_name = "PATH")]
    pub(crate) users: std::path::PathBuf,
    /// A work queue to show (repeatable).
    #[arg(long = "queue", value_name = "QUEUE")]
    pub(crate) queues: Vec<String>,
    /// An edge worker's failure keeper, NAME=URL (repeatable); the token
    /// is read from JOBRAIL_EDGE_TOKEN, or JOBRAIL_EDGE_TOKEN_<NAME>.
    #[arg(long = "edge", value_name = "NAME=URL")]
    pub(crate) edges: Vec<String>,
    /// Show records' payloads on their pages (off by default: payloads
    /// may hold personal data or secrets).
    #[arg(long)]
    pub(crate) show_payloads: bool,
    /// The path the dashboard is served under behind a proxy (`/ops`).
    #[arg(long, default_value = "")]
    pub(crate) base_path: String,
    /// Where the schedules and their claims are.
    #[command(flatten)]
    pub(crate) source: ScheduleSource,
}

/// The claim stores `jobrail schedules` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum ClaimsKind {
    /// This process's memory: empty, for trying the tool.
    Memory,
    /// Postgres (`--database-url`, `DATABASE_URL`; `--claims-table`).
    Postgres,
    /// Redis (`--redis-url`, `REDIS_URL`).
    Redis,
}

/// Where `jobrail schedules` finds the schedules and their claims.
#[derive(Debug, Clone, Args)]
pub(crate) struct ScheduleSource {
    /// The configuration file with the `[schedules.<name>]` tables.
    #[arg(long, env = "JOBRAIL_CONFIG", value_name = "PATH")]
    pub(crate) config: Option<std::path::PathBuf>,
    /// The claim store the schedulers share.
    #[arg(long, value_enum, default_value = "memory")]
    pub(crate) claims: ClaimsKind,
    /// The Postgres claims table.
    #[arg(long, default_value = "jobrail_claims")]
    pub(crate) claims_table: String,
    /// The Redis URL of the claims [default: redis://127.0.0.1:6379].
    #[arg(
        long,
        env = "REDIS_URL",
        hide_env_values = true,
        default_value = "redis://127.0.0.1:6379",
        hide_default_value = true
    )]
    pub(crate) redis_url: String,
    /// The Redis key prefix of the claims.
    #[arg(long, default_value = "jobrail:claim:")]
    pub(crate) redis_prefix: String,
}

/// `jobrail schedules ...`
#[derive(Debug, Subcommand)]
pub(crate) enum Schedules {
    /// Each schedule: cron, zone, policies, the next ticks and the last ticks fired.
    List {
        /// Where the schedules and their claims are.
        #[command(flatten)]
        source: ScheduleSource,
        /// How many next ticks to show.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=100))]
        next: u16,
        /// How many of the latest due ticks to read from the claim store.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=100))]
        last: u16,
    },
    /// Dispatch a schedule's job now, through --backend, as a `manual` tick.
    Trigger {
        /// Where the schedules are.
        #[command(flatten)]
        source: ScheduleSource,
        /// The schedule's name.
        name: String,
    },
}

/// `jobrail failed ...`
#[derive(Debug, Subcommand)]
pub(crate) enum Failed {
    /// List a queue's failure records, oldest first, without consuming them.
    List {
        /// The work queue whose failures to list.
        #[arg(long)]
        queue: String,
        /// At most this many records.
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u16).range(1..=10_000))]
        limit: u16,
        /// Start after this cursor (printed at the end of the previous page).
        #[arg(long, value_name = "CURSOR")]
        after: Option<String>,
    },
    /// Show one record in full: its envelope, reason and whether it can be replayed.
    Show {
        /// The work queue.
        #[arg(long)]
        queue: String,
        /// The record's id, or the failed message's id.
        id: String,
    },
    /// Send a record's message back to its queue as a new delivery, then remove the record.
    Replay {
        /// The work queue.
        #[arg(long)]
        queue: String,
        /// The record's id, or the failed message's id.
        id: String,
        /// Replay a poison record too (its stored body is sent as it is).
        #[arg(long)]
        force: bool,
    },
    /// Remove records: one, all, or those older than an age.
    #[command(group(ArgGroup::new("which").required(true).args(["id", "all", "older_than"])))]
    Purge {
        /// The work queue.
        #[arg(long)]
        queue: String,
        /// The record with this id (record or message id).
        #[arg(long)]
        id: Option<String>,
        /// Every record.
        #[arg(long)]
        all: bool,
        /// Records that failed longer ago than this (`7d`, `36h`, `90m`).
        #[arg(long, value_name = "AGE", value_parser = parse_age)]
        older_than: Option<Duration>,
    },
}

/// An age such as `7d` or `1h 30m`.
fn parse_age(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|e| format!("`{text}` is not a duration such as 7d, 36h or 90m: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::error::ErrorKind;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("jobrail").chain(args.iter().copied()))
    }

    #[test]
    fn the_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn list_takes_a_page() {
        let cli = parse(&[
            "failed", "list", "--queue", "reports", "--limit", "2", "--after", "5:abc",
        ])
        .unwrap();
        match cli.command {
            Command::Failed(Failed::List {
                queue,
                limit,
                after,
            }) => {
                assert_eq!(
                    (queue.as_str(), limit, after.as_deref()),
                    ("reports", 2, Some("5:abc"))
                );
            }
            other => panic!("{other:?}"),
        }
        let cli = parse(&["failed", "list", "--queue", "q"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Failed(Failed::List {
                limit: 50,
                after: None,
                ..
            })
        ));
        let err = parse(&["failed", "list", "--queue", "q", "--limit", "0"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ValueValidation);
        let err = parse(&["failed", "list"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::MissingRequiredArgument);
    }

    #[test]
    fn purge_takes_exactly_one_selection() {
        let err = parse(&["failed", "purge", "--queue", "q"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::MissingRequiredArgument);
        let err = parse(&["failed", "purge", "--queue", "q", "--all", "--id", "x"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ArgumentConflict);
        let cli = parse(&["failed", "purge", "--queue", "q", "--older-than", "7d"]).unwrap();
        match cli.command {
            Command::Failed(Failed::Purge { older_than, .. }) => {
                assert_eq!(older_than, Some(Duration::from_secs(7 * 24 * 3600)));
            }
            other => panic!("{other:?}"),
        }
        let cli = parse(&["failed", "purge", "--queue", "q", "--older-than", "1h 30m"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Failed(Failed::Purge { older_than: Some(d), .. }) if d == Duration::from_secs(5400)
        ));
        let err =
            parse(&["failed", "purge", "--queue", "q", "--older-than", "a week"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ValueValidation);
        assert!(err.to_string().contains("not a duration"), "{err}");
    }

    #[test]
    fn global_flags_go_anywhere() {
        let cli = parse(&[
            "failed",
            "replay",
            "--queue",
            "q",
            "abc",
            "--force",
            "--json",
            "--backend",
            "nats",
            "--nats-url",
            "nats://10.0.0.1:4222",
        ])
        .unwrap();
        assert!(cli.json);
        assert_eq!(cli.connection.backend, Some(BackendKind::Nats));
        assert_eq!(cli.connection.nats_url, "nats://10.0.0.1:4222");
        assert!(matches!(
            cli.command,
            Command::Failed(Failed::Replay { force: true, ref id, .. }) if id == "abc"
        ));
        let err = parse(&["--backend", "kafka", "depth", "--queue", "q"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidValue);
    }

    #[test]
    fn postgres_takes_a_url_and_a_schema() {
        let cli = parse(&[
            "--backend",
            "postgres",
            "--database-url",
            "postgres://app@db/shop",
            "--schema",
            "queue_a",
            "install",
            "--print",
        ])
        .unwrap();
        assert_eq!(cli.connection.backend, Some(BackendKind::Postgres));
        assert_eq!(cli.connection.database_url, "postgres://app@db/shop");
        assert_eq!(cli.connection.schema, "queue_a");
        assert!(matches!(cli.command, Command::Install { print: true }));
        let cli = parse(&["install"]).unwrap();
        assert!(matches!(cli.command, Command::Install { print: false }));
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn the_default_schema_is_the_drivers() {
        assert_eq!(DEFAULT_SCHEMA, jobrail_postgres::DEFAULT_SCHEMA);
    }

    #[test]
    fn budget_takes_extra_jobs() {
        let cli = parse(&["budget", "--job", "a", "--job", "b"]).unwrap();
        assert!(matches!(cli.command, Command::Budget { ref jobs } if jobs == &["a", "b"]));
    }
}
