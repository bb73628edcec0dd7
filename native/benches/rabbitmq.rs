//! What the RabbitMQ driver costs over using lapin directly, against the
//! local broker (`RABBITMQ_URL`), in the same run.
//!
//! Both sides publish N persistent messages one at a time, each awaiting its
//! publisher confirm (what the driver does for every dispatch), to a quorum
//! queue, then consume them with prefetch 8 and acknowledge each; the two
//! phases are timed apart (medians of 5 rounds). The facade side goes through
//! `Producer::dispatch` and a `Consumer` with concurrency 8 running a no-op
//! handler (envelope and payload decoding, the rules, events, settlement
//! included); the lapin side decodes the payload and acks in order.
//!
//! Run: `cargo bench -p jobrail-native --features rabbitmq --bench rabbitmq`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use jobrail::{Job, JobContext, Registry};
use jobrail_native::rabbitmq::{RabbitConfig, RabbitDriver};
use jobrail_native::{Consumer, Driver, Producer};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use serde::{Deserialize, Serialize};

const N: u64 = 2_000;

#[derive(Serialize, Deserialize)]
struct Work {
    id: u64,
}

fn url() -> String {
    std::env::var("RABBITMQ_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

async fn raw_lapin(queue: &str) -> (Duration, Duration) {
    let started = Instant::now();
    let properties = ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio);
    let connection = Connection::connect(&url(), properties).await.unwrap();
    let channel = connection.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    channel.queue_declare(queue, durable, args).await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for id in 0..N {
        let body = serde_json::to_vec(&Work { id }).unwrap();
        channel
            .basic_publish(
                "",
                queue,
                BasicPublishOptions::default(),
                &body,
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let published = started.elapsed();
    let started = Instant::now();
    let consumer_channel = connection.create_channel().await.unwrap();
    consumer_channel
        .basic_qos(8, BasicQosOptions::default())
        .await
        .unwrap();
    let mut consumer = consumer_channel
        .basic_consume(
            queue,
            "",
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for _ in 0..N {
        let delivery = consumer.next().await.unwrap().unwrap();
        let work: Work = serde_json::from_slice(&delivery.data).unwrap();
        std::hint::black_box(work.id);
        delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    let consumed = started.elapsed();
    channel
        .queue_delete(queue, QueueDeleteOptions::default())
        .await
        .unwrap();
    connection.close(200, "done").await.unwrap();
    (published, consumed)
}

async fn facade(queue: &str) -> (Duration, Duration) {
    let started = Instant::now();
    let driver = RabbitDriver::connect(RabbitConfig::new(url()).failure_queue(None))
        .await
        .unwrap();
    let job = Job::<Work>::builder("bench").queue(queue).build().unwrap();
    let producer = Producer::new(Arc::new(driver.clone()));
    for id in 0..N {
        producer.dispatch(&job, &Work { id }).await.unwrap();
    }
    let published = started.elapsed();
    let started = Instant::now();
    let mut registry = Registry::new();
    registry
        .register(&job, |_: JobContext, work: Work| async move {
            std::hint::black_box(work.id);
            Ok(())
        })
        .unwrap();
    let consumer = Consumer::builder(Arc::new(driver.clone()), registry)
        .concurrency(8)
        .build()
        .spawn();
    while consumer.registry().stats().job("bench").first_attempt < N {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let consumed = started.elapsed();
    consumer.shutdown().await.unwrap();
    let _ = driver.delete_queues(&driver.declared_queues()).await;
    driver.stop().await.unwrap();
    (published, consumed)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[tokio::main]
async fn main() {
    let (mut raw_pub, mut raw_con, mut our_pub, mut our_con) = (vec![], vec![], vec![], vec![]);
    for round in 0..5 {
        let suffix = jobrail::new_message_id();
        let (p, c) = raw_lapin(&format!("bench-raw-{round}-{suffix}")).await;
        raw_pub.push(p);
        raw_con.push(c);
        let (p, c) = facade(&format!("bench-facade-{round}-{suffix}")).await;
        our_pub.push(p);
        our_con.push(c);
    }
    let report = |what: &str, raw: Duration, ours: Duration| {
        println!(
            "rabbitmq {what}: lapin {raw:?}, facade {ours:?}, ratio {:.2}",
            ours.as_secs_f64() / raw.as_secs_f64()
        );
    };
    report(
        &format!("{N} confirmed publishes"),
        median(raw_pub),
        median(our_pub),
    );
    report(
        &format!("consuming and acking {N} at prefetch 8"),
        median(raw_con),
        median(our_con),
    );
}
