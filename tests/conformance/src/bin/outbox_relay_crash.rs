//! A relay that dies between the broker's confirm and its mark, for the
//! outbox's crash test (`tests/outbox.rs`).
//!
//! `outbox_relay_crash rabbitmq <table>` runs one pass of an
//! [`OutboxRelay`] over the outbox
//! table `<table>` (database at `DATABASE_URL`), publishing to RabbitMQ at
//! `RABBITMQ_URL` (feature `rabbitmq`) through a driver that, once the
//! broker has confirmed a batch, prints `confirmed N` and aborts the
//! process: the relay's transaction never commits its marks.

use std::process::ExitCode;
use std::sync::Arc;

use async_trait::async_trait;
use jobrail_native::{
    Admin, Capabilities, Driver, DriverError, FailureStore, Outgoing, Producer, Subscription,
};
use jobrail_postgres::{Outbox, OutboxRelay, PgConnect};

/// Delegates to a real driver, and aborts the process as soon as a batch
/// it sent comes back confirmed.
struct AbortAfterConfirm(Arc<dyn Driver>);

#[async_trait]
impl Driver for AbortAfterConfirm {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }
    async fn send(&self, queue: &str, message: Outgoing) -> Result<(), DriverError> {
        let result = self.0.send(queue, message).await;
        if result.is_ok() {
            die(1);
        }
        result
    }
    async fn send_batch(
        &self,
        queue: &str,
        messages: Vec<Outgoing>,
    ) -> Vec<Result<(), DriverError>> {
        let results = self.0.send_batch(queue, messages).await;
        let confirmed = results.iter().filter(|r| r.is_ok()).count();
        if confirmed > 0 {
            die(confirmed);
        }
        results
    }
    async fn subscribe(
        &self,
        queue: &str,
        prefetch: usize,
    ) -> Result<Box<dyn Subscription>, DriverError> {
        self.0.subscribe(queue, prefetch).await
    }
    async fn stop(&self) -> Result<(), DriverError> {
        self.0.stop().await
    }
    fn failure_store(&self) -> Option<&dyn FailureStore> {
        self.0.failure_store()
    }
    fn admin(&self) -> Option<&dyn Admin> {
        self.0.admin()
    }
}

/// Reports what the broker confirmed, then dies without unwinding.
fn die(confirmed: usize) -> ! {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "confirmed {confirmed}");
    let _ = out.flush();
    std::process::abort()
}

async fn broker(name: &str) -> Result<Arc<dyn Driver>, String> {
    match name {
        #[cfg(feature = "rabbitmq")]
        "rabbitmq" => {
            use jobrail_native::rabbitmq::{RabbitConfig, RabbitDriver};
            let url = std::env::var("RABBITMQ_URL")
                .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
            let mut config = RabbitConfig::new(url);
            config.connection_name = "outbox-relay-crash".into();
            let driver = RabbitDriver::connect(config)
                .await
                .map_err(|e| e.to_string())?;
            Ok(Arc::new(driver))
        }
        other => Err(format!(
            "broker `{other}` unknown or its feature is off (rabbitmq)"
        )),
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let (Some(name), Some(table)) = (args.next(), args.next()) else {
        eprintln!("usage: outbox_relay_crash rabbitmq <table>");
        return ExitCode::from(2);
    };
    let database = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let outbox = match Outbox::with_table(table) {
        Ok(outbox) => outbox,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let driver = match broker(&name).await {
        Ok(driver) => driver,
        Err(e) => {
            eprintln!("outbox_relay_crash: {e}");
            return ExitCode::from(2);
        }
    };
    let producer = Producer::new(Arc::new(AbortAfterConfirm(driver)));
    let connect = match PgConnect::new(&database) {
        Ok(connect) => connect,
        Err(e) => {
            eprintln!("outbox_relay_crash: DATABASE_URL: {e}");
            return ExitCode::from(2);
        }
    };
    let relay = OutboxRelay::new(&connect, outbox, producer);
    match relay.run_once().await {
        Ok(pass) => {
            println!("pass ended without a confirm: {pass:?}");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("outbox_relay_crash: {e}");
            ExitCode::from(1)
        }
    }
}
