//! The exactly-once charge: a handler that charges an account through a
//! claim on Postgres (`jobrail_postgres::PgClaims`), the charge and
//! the claim's completion committed in one transaction.
//!
//! The worker side ([`register`]) appends to the run's ledger file, one
//! `write` each:
//!
//! - `deliver <id> <pid>`: a delivery reached the handler (before anything
//!   else, so redeliveries show);
//! - `skip <id> <pid>`: the claim said the charge is done already;
//! - `held <id> <pid>`: another holder's lease was live (the delivery is
//!   retried after it);
//! - `lost <id> <pid> <fence>`: the completion came too late (the
//!   transaction is rolled back and the delivery retried).
//!
//! The charges themselves are rows of the ledger TABLE
//! (`id, amount_cents, pid, fence`), with no unique key, so a second charge
//! of an id would show as a second row. The orchestrator side ([`Ledger`])
//! creates both tables, counts the rows per id and drops the tables.

/// The claim's lease.
#[cfg(feature = "postgres")]
pub(crate) const LEASE: std::time::Duration = std::time::Duration::from_secs(2);

/// The environment variable with the Postgres URL.
pub(crate) const DATABASE_URL_VAR: &str = "DATABASE_URL";

/// The Postgres URL of the run (`DATABASE_URL`, or the local default).
pub(crate) fn database_url() -> String {
    std::env::var(DATABASE_URL_VAR)
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// The tables of one charge run.
#[derive(Clone, Debug)]
pub(crate) struct Tables {
    /// The claim store's table.
    pub(crate) claims: String,
    /// The ledger of charges.
    pub(crate) ledger: String,
}

impl Tables {
    /// `faults_<run>_<backend>_claims` and `..._ledger` (a backend per
    /// table pair: the business ids repeat across backends).
    #[cfg(feature = "postgres")]
    pub(crate) fn new(run: &str, backend: &str) -> Tables {
        Tables {
            claims: format!("faults_{run}_{backend}_claims"),
            ledger: format!("faults_{run}_{backend}_ledger"),
        }
    }
}

/// The amount charged for business id `id`, in cents.
#[cfg(feature = "postgres")]
fn amount_cents(id: u64) -> i64 {
    100 + (id % 900) as i64
}

#[cfg(feature = "postgres-queue")]
pub(crate) use pg::register_tx;
#[cfg(feature = "postgres")]
pub(crate) use pg::{password, register, Ledger};

#[cfg(feature = "postgres")]
mod pg {
    use std::collections::BTreeMap;
    use std::fs::File;
    use std::sync::Arc;

    use futures_util::stream::{self, StreamExt};
    use jobrail::{Claim, ClaimError, ClaimStore, Job, JobContext, JobError, Registry};
    use jobrail_postgres::{PgClaims, PgConnect};
    use tokio::sync::{Mutex, MutexGuard};
    use tokio_postgres::{Client, NoTls};

    use super::{amount_cents, database_url, Tables, DATABASE_URL_VAR, LEASE};
    use crate::worker::{append, Item};

    /// Connects to `url` and drives the connection on a task.
    async fn connect(url: &str) -> Result<Client, tokio_postgres::Error> {
        let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "postgres connection ended");
            }
        });
        Ok(client)
    }

    /// The password in `url`, if any (a secret the logs must not show).
    pub(crate) fn password(url: &str) -> Option<String> {
        let config: tokio_postgres::Config = url.parse().ok()?;
        let password = config.get_password()?;
        Some(String::from_utf8_lossy(password).into_owned())
    }

    /// One connection per concurrent handler (a transaction holds its
    /// connection), opened on first use and again once closed.
    struct Pool {
        connect: PgConnect,
        slots: Vec<Mutex<Option<Client>>>,
    }

    impl Pool {
        fn new(connect: PgConnect, size: usize) -> Pool {
            Pool {
                connect,
                slots: (0..size.max(1)).map(|_| Mutex::new(None)).collect(),
            }
        }

        /// A free connection (or, if none is free, the next one to be).
        async fn get(&self) -> Result<MutexGuard<'_, Option<Client>>, tokio_postgres::Error> {
            let mut slot = match self.slots.iter().find_map(|s| s.try_lock().ok()) {
                Some(slot) => slot,
                None => self.slots[fastrand::usize(..self.slots.len())].lock().await,
            };
            if slot.as_ref().is_none_or(Client::is_closed) {
                *slot = Some(self.connect.connect().await?);
            }
            Ok(slot)
        }
    }

    /// How long a charge's transaction may take before it is given up
    /// (its connection dropped, the charge retried): what a careful
    /// application bounds its own statements by, so that a connection
    /// whose server went silent (a partition, a half-open link) does not
    /// hold the handler until the job's timeout.
    const CHARGE_BOUND: std::time::Duration = std::time::Duration::from_secs(10);

    /// `charge` within [`CHARGE_BOUND`]; past it, a retry.
    async fn bounded(
        charge: impl std::future::Future<Output = Result<(), JobError>>,
    ) -> Result<(), JobError> {
        tokio::time::timeout(CHARGE_BOUND, charge)
            .await
            .unwrap_or_else(|_| {
                Err(JobError::new(format!(
                    "the charge's transaction got no answer within {CHARGE_BOUND:?}"
                )))
            })
    }

    /// 0–20 ms, so that kills land at every step: before the claim, inside
    /// the transaction, between the commit and the acknowledgement.
    async fn pause() {
        tokio::time::sleep(std::time::Duration::from_millis(fastrand::u64(0..=20))).await;
    }

    /// Registers the charging handler for `job`: claim `charge:<id>`, then
    /// in one transaction the ledger row and the claim's completion.
    pub(crate) async fn register(
        registry: &mut Registry,
        job: &Job<Item>,
        ledger: Arc<File>,
        tables: &Tables,
        concurrency: usize,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let url = database_url();
        let claims = Arc::new(PgClaims::connect_with_table(&url, &tables.claims).await?);
        let pool = Arc::new(Pool::new(PgConnect::new(&url)?, concurrency));
        let insert: Arc<str> = format!(
            "INSERT INTO {} (id, amount_cents, pid, fence) VALUES ($1, $2, $3, $4)",
            tables.ledger
        )
        .into();
        let pid = std::process::id();
        registry.register(job, move |_ctx: JobContext, item: Item| {
            let (claims, pool, ledger, insert) =
                (claims.clone(), pool.clone(), ledger.clone(), insert.clone());
            async move {
                let id = item.id;
                append(&ledger, &format!("deliver {id} {pid}\n"));
                pause().await;
                let key = format!("charge:{id}");
                let claim = claims.claim(&key, LEASE).await?;
                match claim {
                    Claim::Done => append(&ledger, &format!("skip {id} {pid}\n")),
                    Claim::Held { .. } => append(&ledger, &format!("held {id} {pid}\n")),
                    Claim::Claimed { .. } => {}
                }
                let Some(fence) = claim.proceed(&key)? else {
                    return Ok(());
                };
                let charged = bounded(async {
                    let mut slot = pool.get().await?;
                    // Owned while in use: if the bound drops this future,
                    // the connection goes with it and the slot opens anew.
                    let mut client = slot.take().expect("the pool connected the slot");
                    let charged = async {
                        let tx = client.transaction().await?;
                        pause().await;
                        tx.execute(
                            &*insert,
                            &[
                                &(id as i64),
                                &amount_cents(id),
                                &i64::from(pid),
                                &(fence as i64),
                            ],
                        )
                        .await?;
                        // Dropping the transaction on an error rolls it back.
                        claims.complete_in(&tx, &key, fence).await?;
                        tx.commit().await?;
                        Ok::<(), JobError>(())
                    }
                    .await;
                    *slot = Some(client);
                    charged
                })
                .await;
                if charged.is_ok() {
                    // A kill here, after the commit and before the
                    // acknowledgement, redelivers a charge that is done.
                    pause().await;
                }
                if let Err(e) = charged {
                    match e.find::<ClaimError>() {
                        Some(ClaimError::Lost { .. }) => {
                            append(&ledger, &format!("lost {id} {pid} {fence}\n"));
                        }
                        // The charge did not commit (or the commit's answer
                        // was lost): free the key for the retry; if it did
                        // commit, the key is done and this is refused.
                        _ => {
                            let _ = claims.release(&key, fence).await;
                        }
                    }
                    return Err(e);
                }
                Ok(())
            }
        })?;
        Ok(())
    }

    /// Registers the transactional charging handler for `job` on the
    /// Postgres queue `driver`: in one transaction of its own (a connection
    /// per concurrent handler, to the queue's database), the ledger row and
    /// the job's completion (`PgDriver::complete_in`, fenced by the
    /// delivery's lease), then the commit. No claim: the job's row is gone
    /// if and only if its charge committed.
    #[cfg(feature = "postgres-queue")]
    pub(crate) async fn register_tx(
        registry: &mut Registry,
        job: &Job<Item>,
        ledger: Arc<File>,
        table: &str,
        driver: jobrail_postgres::PgDriver,
        concurrency: usize,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let pool = Arc::new(Pool::new(driver.config().connect.clone(), concurrency));
        let insert: Arc<str> =
            format!("INSERT INTO {table} (id, amount_cents, pid, fence) VALUES ($1, $2, $3, $4)")
                .into();
        let pid = std::process::id();
        registry.register(job, move |ctx: JobContext, item: Item| {
            let (driver, pool, ledger, insert) =
                (driver.clone(), pool.clone(), ledger.clone(), insert.clone());
            async move {
                let id = item.id;
                append(&ledger, &format!("deliver {id} {pid}\n"));
                pause().await;
                // The attempt stands in for the fence: above 1, the charge
                // was made by a redelivery.
                let attempt = i64::from(ctx.attempt());
                let charged = bounded(async {
                    let mut slot = pool.get().await?;
                    // Owned while in use, as above.
                    let mut client = slot.take().expect("the pool connected the slot");
                    let charged = async {
                        let tx = client.transaction().await?;
                        pause().await;
                        tx.execute(
                            &*insert,
                            &[&(id as i64), &amount_cents(id), &i64::from(pid), &attempt],
                        )
                        .await?;
                        // Dropping the transaction on an error rolls it back.
                        if let Err(e) = driver.complete_in(&tx, &ctx).await {
                            if e.kind() == jobrail_native::ErrorKind::NotAccepted {
                                append(&ledger, &format!("lost {id} {pid} {attempt}\n"));
                            }
                            return Err(JobError::from(e));
                        }
                        pause().await;
                        tx.commit().await?;
                        Ok::<(), JobError>(())
                    }
                    .await;
                    *slot = Some(client);
                    charged
                })
                .await;
                if charged.is_ok() {
                    // A kill here, after the commit and before the
                    // settlement: the row is gone, nothing comes back.
                    pause().await;
                }
                charged
            }
        })?;
        Ok(())
    }

    /// The ledger rows of one business id.
    #[derive(Clone, Copy, Debug, Default)]
    pub(crate) struct Charges {
        /// Rows (charges) of the id.
        pub(crate) rows: usize,
        /// The highest fence a charge of the id was made under.
        pub(crate) fence: u64,
    }

    /// The orchestrator's view of a charge run's tables.
    pub(crate) struct Ledger {
        client: Client,
        claims: PgClaims,
        tables: Tables,
    }

    impl Ledger {
        /// Creates the run's ledger table and its claim store's table.
        pub(crate) async fn create(url: &str, tables: &Tables) -> Result<Ledger, String> {
            let client = connect(url)
                .await
                .map_err(|e| format!("cannot connect to Postgres (`{DATABASE_URL_VAR}`): {e}"))?;
            client
                .batch_execute(&format!(
                    "DROP TABLE IF EXISTS {0}; CREATE TABLE {0} (
                        id BIGINT NOT NULL,
                        amount_cents BIGINT NOT NULL,
                        pid BIGINT NOT NULL,
                        fence BIGINT NOT NULL,
                        at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
                    )",
                    tables.ledger
                ))
                .await
                .map_err(|e| format!("creating {}: {e}", tables.ledger))?;
            let claims = PgClaims::connect_with_table(url, &tables.claims)
                .await
                .map_err(|e| format!("creating the claim table {}: {e}", tables.claims))?;
            Ok(Ledger {
                client,
                claims,
                tables: tables.clone(),
            })
        }

        /// The charges per business id, from the ledger table.
        pub(crate) async fn charges(&self) -> Result<BTreeMap<u64, Charges>, String> {
            let rows = self
                .client
                .query(
                    &format!(
                        "SELECT id, count(*), max(fence) FROM {} GROUP BY id",
                        self.tables.ledger
                    ),
                    &[],
                )
                .await
                .map_err(|e| format!("reading {}: {e}", self.tables.ledger))?;
            Ok(rows
                .iter()
                .map(|row| {
                    let id: i64 = row.get(0);
                    let count: i64 = row.get(1);
                    let fence: i64 = row.get(2);
                    (
                        id as u64,
                        Charges {
                            rows: count as usize,
                            fence: fence as u64,
                        },
                    )
                })
                .collect())
        }

        /// When the first charge after `after` was made (by process `pid`
        /// if given), as seconds since the Unix epoch.
        pub(crate) async fn first_charge_after(
            &self,
            after: std::time::SystemTime,
            pid: Option<u32>,
        ) -> Result<Option<f64>, String> {
            let after = after
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs_f64();
            let pid = pid.map(i64::from);
            let row = self
                .client
                .query_one(
                    &format!(
                        "SELECT extract(epoch FROM min(at))::float8 FROM {}
                         WHERE at > to_timestamp($1) AND ($2::bigint IS NULL OR pid = $2)",
                        self.tables.ledger
                    ),
                    &[&after, &pid],
                )
                .await
                .map_err(|e| format!("reading {}: {e}", self.tables.ledger))?;
            Ok(row.get(0))
        }

        /// Of `ids`, those whose key a new claim does not find done (each
        /// charged id must: its completion committed with its charge).
        pub(crate) async fn not_done(&self, ids: Vec<u64>) -> Result<Vec<u64>, String> {
            let answers: Vec<(u64, Result<Claim, ClaimError>)> = stream::iter(ids)
                .map(|id| async move {
                    let key = format!("charge:{id}");
                    (id, self.claims.claim(&key, LEASE).await)
                })
                .buffer_unordered(8)
                .collect()
                .await;
            let mut not_done = vec![];
            for (id, answer) in answers {
                match answer {
                    Ok(Claim::Done) => {}
                    Ok(_) => not_done.push(id),
                    Err(e) => return Err(format!("claiming charge:{id} again: {e}")),
                }
            }
            not_done.sort_unstable();
            Ok(not_done)
        }

        /// Drops both tables.
        pub(crate) async fn drop_tables(&self) -> Result<(), String> {
            self.client
                .batch_execute(&format!(
                    "DROP TABLE IF EXISTS {}; DROP TABLE IF EXISTS {}",
                    self.tables.ledger, self.tables.claims
                ))
                .await
                .map_err(|e| format!("dropping the run's tables: {e}"))
        }
    }
}
