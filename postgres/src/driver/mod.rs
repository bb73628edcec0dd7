//! The queue on Postgres: [`PgDriver`], a [`Driver`] whose messages are
//! rows of a table in the application's own database.
//!
//! # Tables
//!
//! One schema (default `jobrail`, [`PgConfig::schema`]) holds the tables
//! `jobs`, `failures` and `migrations`, the sequence `leases` and the
//! index `jobs_fetch`. [`PgDriver::install`] creates them,
//! or upgrades them from an earlier version, in one transaction under an
//! advisory lock; [`PgDriver::install_sql`] gives the same SQL for a
//! migration tool. [`PgDriver::connect`] never creates anything: it
//! refuses, with [`ErrorKind::Config`] naming the fix, a schema that is
//! missing or at another version. A finished message's row is deleted, so
//! the table and its index hold only what is still to do, whatever the
//! history.
//!
//! # Dispatch
//!
//! One multi-row `INSERT` per batch ([`Driver::send_batch`]: every message
//! of it stored, or none). Single dispatches are batched too: those sent
//! while the insert before them is in flight go together in one `INSERT`
//! and one commit (a lone dispatch is inserted at once), so concurrent
//! producers share commits; a failed insert fails each of its messages
//! with the same error. A delay sets
//! the row's run time, on the server's clock, to any time ahead (no
//! maximum), rounded up to the microsecond. A body over
//! [`max_message_bytes`](PgConfig::max_message_bytes) is refused before any
//! I/O. [`PgDriver::dispatch_in`] inserts inside the caller's own
//! transaction: the job exists if and only if that transaction commits.
//! A statement the server refused stored nothing
//! ([`ErrorKind::NotAccepted`]); one whose connection was lost before the
//! answer may have ([`ErrorKind::Uncertain`]).
//!
//! # Consumption
//!
//! A subscription fetches while its prefetch has room: one statement
//! takes up to [`fetch_batch`](PgConfig::fetch_batch) due rows, oldest run
//! time first, with `FOR UPDATE SKIP LOCKED` (workers never wait on each
//! other's rows), and gives each a new fencing token (`lease`), one more
//! attempt and the end of its lease as its run time. With nothing due it
//! waits for a notification (`LISTEN` on `jobrail.<schema>`: the driver
//! notifies after its inserts, coalescing them to one notification in
//! flight per queue, and [`PgDriver::dispatch_in`] notifies at the caller's
//! commit), the next row's due time (a delay or a lease
//! ending), or at most [`poll_interval`](PgConfig::poll_interval), whichever
//! comes first: an idle worker picks a new job up within milliseconds and
//! otherwise reads the table once per poll interval. A lost listening
//! connection is opened again; meanwhile the subscriptions poll.
//!
//! # Leases and fencing
//!
//! A delivery holds its row for [`lease`](PgConfig::lease) (default 30 s),
//! renewed every half lease while the handler runs, so a handler of any
//! length keeps it. Every settlement names the row and the token: once a
//! lease ended (the worker died, or was cut off longer than the lease)
//! and another fetch took the row, the old holder's settlement matches no
//! row and is refused ([`ErrorKind::NotAccepted`], "lease was taken over"),
//! never applied twice. A delivery dropped unsettled is due again at once.
//!
//! # Attempts
//!
//! The row counts deliveries: every fetch adds one, so a delivery whose
//! worker crashed counts when its lease ends. A graceful shutdown's retry
//! adds to `shutdowns` ([`Delivery::shutdown_returns`]), which the rules
//! take off the count: shutdowns never consume a job's cap. A row fetched
//! but never handed to a handler (buffered when its subscription closed)
//! gives its attempt back.
//!
//! # Settlements
//!
//! - Ack and reject: the row is deleted. Acknowledgements that arrive
//!   while the batch before them is in flight go together in one `DELETE`
//!   (one batch in flight per driver), so a busy worker commits once per
//!   batch, and each learns whether its own row matched.
//! - Retry: the lease is cleared and the run time set to the delay's end,
//!   any time ahead (a zero delay is due at once, and a notification goes
//!   out). A retry without a delay (the backend's own timing) comes back
//!   one lease later ([`Capabilities::redelivery_hint`]).
//! - Fail: one statement deletes the row and inserts the failure record
//!   into `failures`: both or neither.
//! - [`PgDriver::complete_in`]: the handler deletes its row inside its own
//!   transaction, so its database writes and the job's completion commit
//!   together; the settlement that follows finds the row gone and is done.
//!
//! # Failure records
//!
//! `failures` holds each record with its entry id and message id, in the
//! order stored, behind [`FailureStore`]: [`Failures`](jobrail_native::Failures)
//! and the `jobrail` CLI list, show, replay and purge them. A claim on an
//! entry holds for a minute if its operator neither removes nor releases it.
//!
//! # Errors
//!
//! Every error from a statement keeps tokio-postgres's error as its cause
//! ([`DriverError::find`]).

mod acks;
mod config;
mod connection;
mod delivery;
mod errors;
mod failures;
mod publish;
#[cfg(feature = "testing")]
mod testing;
mod ticks;
mod topology;

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use jobrail::JobContext;
use jobrail_native::kit::{lock, Lifecycle};
use jobrail_native::{
    Admin, Capabilities, Driver, DriverError, ErrorKind, FailureStore, Outgoing, Subscription,
};
use tokio_postgres::types::Type;
use tokio_postgres::GenericClient;

pub use config::{PgConfig, DEFAULT_SCHEMA, MAX_MESSAGE_BYTES_LIMIT};
pub use ticks::PgTicks;
pub use topology::SCHEMA_VERSION;

use acks::Acks;
use connection::{Announcer, Pool, Waiters};
use delivery::{PgDelivery, PgSubscription};
use errors::{write_error, NAME};
use publish::Sends;

/// A delivery as a handler's context names it: queue, message id, attempt.
pub(crate) type HeldKey = (String, String, u32);

/// What [`PgDriver::complete_in`] needs of a delivery in progress.
struct Held {
    id: i64,
    lease: i64,
    completed: Arc<AtomicBool>,
    /// Two deliveries in progress share the key (two rows of one message
    /// id, each at the same attempt): `complete_in` cannot tell which.
    ambiguous: bool,
}

/// The Postgres queue driver. Cheap to clone: clones share the connections.
///
/// ```no_run
/// use std::sync::Arc;
/// use jobrail::{Job, JobContext, Registry};
/// use jobrail_native::{Consumer, Driver, Producer};
/// use jobrail_postgres::{PgConfig, PgDriver};
///
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let config = PgConfig::new("postgres://app@db.internal/shop")?;
/// PgDriver::install(&config).await?; // once, or PgDriver::install_sql in a migration
/// let driver = Arc::new(PgDriver::connect(config).await?);
///
/// let greet = Job::<String>::builder("greet").queue("mail").max_deliveries(5).build()?;
/// Producer::new(driver.clone()).dispatch(&greet).send(&"Ada".to_string()).await?;
///
/// let mut registry = Registry::new();
/// registry.register(&greet, |_ctx: JobContext, name: String| async move {
///     println!("hello, {name}");
///     Ok(())
/// })?;
/// Consumer::builder(driver.clone(), registry).build().run_until_signal().await?;
/// driver.stop().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgDriver {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for PgDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgDriver")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

pub(crate) struct Inner {
    pub(crate) config: PgConfig,
    pub(crate) pool: Arc<Pool>,
    pub(crate) waiters: Arc<Waiters>,
    pub(crate) announcer: Arc<Announcer>,
    /// Started on the first acknowledgement (it needs the runtime).
    acks: OnceLock<Acks>,
    /// Started on the first dispatch (it needs the runtime).
    sends: OnceLock<Sends>,
    pub(crate) life: Lifecycle,
    held: Mutex<HashMap<HeldKey, Held>>,
    queues: Mutex<BTreeSet<String>>,
    listening: Mutex<bool>,
}

impl PgDriver {
    /// A driver on `config`, without I/O: settings checked
    /// ([`ErrorKind::Config`]), nothing connected. The first statement
    /// connects; [`connect`](Self::connect) also checks the schema and
    /// starts listening, and is what a worker should call.
    pub fn new(config: PgConfig) -> Result<PgDriver, DriverError> {
        config.validate()?;
        Ok(PgDriver {
            inner: Arc::new(Inner {
                pool: Arc::new(Pool::new(&config)),
                config,
                waiters: Arc::default(),
                announcer: Arc::default(),
                acks: OnceLock::new(),
                sends: OnceLock::new(),
                life: Lifecycle::new(NAME),
                held: Mutex::default(),
                queues: Mutex::default(),
                listening: Mutex::new(false),
            }),
        })
    }

    /// Connects: checks the settings, that the schema is installed at this
    /// driver's version ([`ErrorKind::Config`] with the fix otherwise), and
    /// starts the listening connection.
    pub async fn connect(config: PgConfig) -> Result<PgDriver, DriverError> {
        let driver = PgDriver::new(config)?;
        driver.inner.pool.check().await?;
        driver.inner.pool.get().await?;
        driver.listen();
        Ok(driver)
    }

    /// Installs the tables in `config`'s schema, or upgrades them to this
    /// driver's [`SCHEMA_VERSION`]: one transaction, under an advisory lock
    /// so that workers installing at once do not race; nothing changes when
    /// they are current. Returns the version found before (0: none). A
    /// schema newer than this driver is refused. Run it from a deploy step
    /// or a worker's start, as you prefer: the driver never runs it on its
    /// own.
    pub async fn install(config: &PgConfig) -> Result<i32, DriverError> {
        config.validate()?;
        let pool = Pool::new(config);
        let mut client = pool.dial().await?;
        topology::install(&mut client, &config.schema).await
    }

    /// The SQL that [`install`](Self::install) runs on an empty database,
    /// for a migration tool of your own (run it once; it records version
    /// [`SCHEMA_VERSION`]).
    pub fn install_sql(schema: &str) -> Result<String, DriverError> {
        config::check_schema(schema)?;
        Ok(topology::install_sql(schema, 0))
    }

    /// The SQL that upgrades `schema` from version `from` to
    /// [`SCHEMA_VERSION`] (empty of migrations when `from` is current).
    pub fn upgrade_sql(schema: &str, from: i32) -> Result<String, DriverError> {
        config::check_schema(schema)?;
        Ok(topology::install_sql(schema, from))
    }

    /// The settings.
    pub fn config(&self) -> &PgConfig {
        &self.inner.config
    }

    /// Completes the delivery `ctx` belongs to inside `client`'s
    /// transaction: deletes its row if this delivery still holds it, so
    /// that the handler's own writes in that transaction and the job's
    /// completion commit together, or neither does. A database-only effect
    /// then happens once, with no claim: a redelivery finds the effect
    /// committed only if the job is gone too.
    ///
    /// Fails, and the caller must roll back, when the lease was taken over
    /// (the row is held by another delivery or finished:
    /// [`ErrorKind::NotAccepted`]), when `ctx` is not a delivery of this
    /// driver in progress ([`ErrorKind::NotFound`]), or when the statement
    /// fails. After the commit the handler returns as usual; its settlement
    /// finds the row gone and does nothing more. If the transaction rolls
    /// back, the delivery is settled as the handler's result says.
    ///
    /// ```no_run
    /// # async fn example(driver: jobrail_postgres::PgDriver, pool: std::sync::Arc<tokio::sync::Mutex<jobrail_postgres::tokio_postgres::Client>>) -> Result<(), Box<dyn std::error::Error>> {
    /// use jobrail::{Job, JobContext, Registry};
    ///
    /// let charge = Job::<i64>::builder("charge").queue("billing").max_deliveries(5).build()?;
    /// let mut registry = Registry::new();
    /// registry.register(&charge, move |ctx: JobContext, order: i64| {
    ///     let (driver, pool) = (driver.clone(), pool.clone());
    ///     async move {
    ///         let mut client = pool.lock().await;
    ///         let tx = client.transaction().await?;
    ///         tx.execute("INSERT INTO charges (order_id) VALUES ($1)", &[&order]).await?;
    ///         driver.complete_in(&tx, &ctx).await?; // fenced: fails if the lease was lost
    ///         tx.commit().await?;
    ///         Ok(())
    ///     }
    /// })?;
    /// # Ok(()) }
    /// ```
    pub async fn complete_in(
        &self,
        client: &impl GenericClient,
        ctx: &JobContext,
    ) -> Result<(), DriverError> {
        let key: HeldKey = (
            ctx.queue().to_owned(),
            ctx.message_id().to_owned(),
            ctx.attempt(),
        );
        let (id, lease, completed) = {
            let held = lock(&self.inner.held);
            let Some(entry) = held.get(&key) else {
                return Err(DriverError::new(
                    NAME,
                    ErrorKind::NotFound,
                    format!(
                        "no delivery of message `{}` (queue `{}`, attempt {}) is in progress on \
                         this driver: complete_in takes the context of a handler this driver's \
                         consumer runs",
                        key.1, key.0, key.2
                    ),
                ));
            };
            if entry.ambiguous {
                return Err(DriverError::new(
                    NAME,
                    ErrorKind::NotAccepted,
                    format!(
                        "two deliveries of message `{}` at attempt {} are in progress on this \
                         driver: complete_in cannot tell which one it completes",
                        key.1, key.2
                    ),
                ));
            }
            (entry.id, entry.lease, entry.completed.clone())
        };
        let n = client
            .execute_typed(
                &self.inner.pool.sql().complete,
                &[(&id, Type::INT8), (&lease, Type::INT8)],
            )
            .await
            .map_err(|e| write_error("complete a delivery in a transaction", e))?;
        if n == 0 {
            return Err(errors::fenced("complete_in", &key.0, &key.1));
        }
        completed.store(true, Ordering::SeqCst);
        Ok(())
    }

    fn listen(&self) {
        let mut listening = lock(&self.inner.listening);
        if *listening {
            return;
        }
        *listening = true;
        tokio::spawn(connection::listen(
            self.inner.config.clone(),
            self.inner.waiters.clone(),
            self.inner.life.watch(),
        ));
    }
}

impl Inner {
    fn capabilities(&self) -> Capabilities {
        let mut capabilities = Capabilities::full();
        capabilities.max_retry_delay = None;
        // A refused settlement leaves the row held until its lease ends:
        // at least half a lease after the last renewal.
        capabilities.refused_hold = self.config.lease / 2;
        // A retry without a delay comes back one lease later.
        capabilities.redelivery_hint = self.config.lease;
        capabilities.max_message_bytes = Some(self.config.max_message_bytes);
        capabilities
    }

    fn hold(&self, delivery: &PgDelivery) {
        let mut held = lock(&self.held);
        held.entry(delivery.key())
            .and_modify(|entry| entry.ambiguous = true)
            .or_insert_with(|| Held {
                id: delivery.row_id(),
                lease: delivery.lease(),
                completed: delivery.completed.clone(),
                ambiguous: false,
            });
    }

    fn unhold(&self, key: &HeldKey) {
        lock(&self.held).remove(key);
    }

    fn declared(&self, queue: &str) {
        lock(&self.queues).insert(queue.to_owned());
    }

    /// Says that `queue` has rows due (see [`Announcer`]).
    pub(crate) fn announce(&self, queue: &str) {
        self.announcer.announce(&self.pool, &self.waiters, queue);
    }

    /// The batched acknowledgements.
    pub(crate) fn acks(&self) -> &Acks {
        self.acks.get_or_init(|| Acks::start(self.pool.clone()))
    }

    /// The batched single dispatches.
    pub(crate) fn sends(&self) -> &Sends {
        self.sends.get_or_init(|| Sends::start(self.pool.clone()))
    }
}

/// `duration` in whole microseconds, rounded up (a delay is never
/// shortened), at most `i64::MAX`.
pub(crate) fn micros(duration: Duration) -> i64 {
    let whole = duration.as_micros() + u128::from(!duration.subsec_nanos().is_multiple_of(1000));
    i64::try_from(whole).unwrap_or(i64::MAX)
}

#[async_trait]
impl Driver for PgDriver {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn send(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        self.inner.send(queue, message).await
    }

    async fn send_batch(
        &self,
        queue: &str,
        messages: Vec<Outgoing>,
    ) -> Vec<Result<(), DriverError>> {
        self.inner.send_batch(queue, messages).await
    }

    async fn subscribe(
        &self,
        queue: &str,
        prefetch: usize,
    ) -> Result<Box<dyn Subscription>, DriverError> {
        self.inner.life.check_running()?;
        self.inner.pool.get().await?;
        self.listen();
        self.inner.declared(queue);
        Ok(Box::new(PgSubscription::start(
            self.inner.clone(),
            queue,
            prefetch,
        )))
    }

    async fn stop(&self) -> Result<(), DriverError> {
        self.inner.life.stop();
        Ok(())
    }

    fn failure_store(&self) -> Option<&dyn FailureStore> {
        Some(self.inner.as_ref())
    }

    fn admin(&self) -> Option<&dyn Admin> {
        Some(self.inner.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_round_up_to_the_microsecond() {
        assert_eq!(micros(Duration::ZERO), 0);
        assert_eq!(micros(Duration::from_nanos(1)), 1);
        assert_eq!(micros(Duration::from_nanos(1_001)), 2);
        assert_eq!(micros(Duration::from_millis(3)), 3_000);
        assert_eq!(micros(Duration::MAX), i64::MAX);
    }
}
