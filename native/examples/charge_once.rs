//! Running an effect once: a charge job whose deliveries repeat (a producer
//! that dispatched twice, an acknowledgement lost after the effect, two
//! workers racing) while the charge itself happens once per order, through
//! a claim on the order id.
//!
//! ```text
//! cargo run -p jobrail-native --example charge_once                       # claims in memory
//! cargo run -p jobrail-native --example charge_once -- --store postgres  # DATABASE_URL
//! cargo run -p jobrail-native --example charge_once -- --store redis     # REDIS_URL
//! ```
//!
//! It prints, per order, how many deliveries the worker saw and how many
//! charges happened, and exits non-zero if any order was charged other than
//! once.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jobrail::{run_once, ClaimStore, Job, JobContext, JobError, MemoryClaims, Once, Registry};
use jobrail_native::{Consumer, MemoryDriver, Producer};
use serde::{Deserialize, Serialize};

/// Charge one order.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ChargeOrder {
    /// The business key: one charge per order, whatever the deliveries.
    order_id: u64,
    cents: u64,
}

/// What the run saw, per order: deliveries and charges.
#[derive(Default)]
struct Ledger {
    deliveries: BTreeMap<u64, u32>,
    charges: BTreeMap<u64, u32>,
    skipped: u32,
}

/// The claim store named by `--store`.
async fn store(name: &str) -> Result<Arc<dyn ClaimStore>, Box<dyn std::error::Error>> {
    match name {
        "memory" => Ok(Arc::new(MemoryClaims::new())),
        "postgres" => {
            let url = std::env::var("DATABASE_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
            Ok(Arc::new(jobrail_postgres::PgClaims::connect(&url).await?))
        }
        "redis" => {
            let url =
                std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
            Ok(Arc::new(jobrail_redis::RedisClaims::connect(&url).await?))
        }
        other => Err(format!("unknown store `{other}`: memory, postgres or redis").into()),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let store_name = args
        .iter()
        .position(|a| a == "--store")
        .and_then(|i| args.get(i + 1))
        .map_or("memory", String::as_str);
    let claims = store(store_name).await?;
    // Keys of this run only, so that every run of the example starts afresh
    // on a store that keeps its claims (Postgres, Redis).
    let run = jobrail::new_message_id();

    let job = Job::<ChargeOrder>::builder("charge-order")
        .queue("charges")
        .max_deliveries(5)
        .backoff(Duration::from_millis(100), 2.0, Duration::from_secs(1))
        .build()?;
    let ledger = Arc::new(Mutex::new(Ledger::default()));

    let mut registry = Registry::new();
    {
        let (claims, ledger) = (claims.clone(), ledger.clone());
        registry.register(&job, move |ctx: JobContext, order: ChargeOrder| {
            let (claims, ledger, run) = (claims.clone(), ledger.clone(), run.clone());
            async move {
                *ledger
                    .lock()
                    .unwrap()
                    .deliveries
                    .entry(order.order_id)
                    .or_default() += 1;
                let key = format!("charge:{run}:{}", order.order_id);
                // The lease outlives the charge; a worker that dies holding
                // it frees the key when it ends.
                let once = run_once(&*claims, &key, Duration::from_secs(2), |_fence| async {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    *ledger
                        .lock()
                        .unwrap()
                        .charges
                        .entry(order.order_id)
                        .or_default() += 1;
                    Ok::<_, JobError>(())
                })
                .await?;
                if once == Once::AlreadyDone {
                    ledger.lock().unwrap().skipped += 1;
                }
                // Order 3's first acknowledgement is "lost" after the charge
                // (as if the worker died between the two): the broker
                // delivers it again.
                if order.order_id == 3 && ctx.attempt() == 1 {
                    return Err(JobError::new("the worker died before acknowledging"));
                }
                Ok(())
            }
        })?;
    }

    let driver = Arc::new(MemoryDriver::default());
    let producer = Producer::new(driver.clone());
    // Every order dispatched twice (a producer that retried an uncertain
    // dispatch), order 5 three times.
    for order_id in 1..=5u64 {
        let copies = if order_id == 5 { 3 } else { 2 };
        for _ in 0..copies {
            producer
                .dispatch(&job)
                .send(&ChargeOrder {
                    order_id,
                    cents: 1_000 * order_id,
                })
                .await?;
        }
    }
    // Two workers' worth of concurrency, so copies of one order race.
    let consumer = Consumer::builder(driver.clone(), registry)
        .concurrency(4)
        .build()
        .spawn();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while driver.depth("charges") > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    consumer.shutdown().await?;

    let ledger = ledger.lock().unwrap();
    println!("store: {store_name}");
    println!("  order  deliveries  charges");
    let mut wrong = 0;
    for (order, deliveries) in &ledger.deliveries {
        let charges = ledger.charges.get(order).copied().unwrap_or(0);
        wrong += usize::from(charges != 1);
        println!("  {order:>5}  {deliveries:>10}  {charges:>7}");
    }
    let deliveries: u32 = ledger.deliveries.values().sum();
    let charges: u32 = ledger.charges.values().sum();
    println!(
        "{deliveries} deliveries, {charges} charges, {} skipped as already done",
        ledger.skipped
    );
    if wrong > 0 || ledger.deliveries.len() != 5 {
        return Err(format!("{wrong} orders were not charged exactly once").into());
    }
    println!("every order charged exactly once");
    Ok(())
}
