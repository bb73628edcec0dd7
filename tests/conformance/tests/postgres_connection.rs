//! jobrail-postgres's connection on the test database (`DATABASE_URL`,
//! default `postgres://postgres@127.0.0.1:5432/test`): the store and the
//! relay come back after the server closed their connection, and
//! `sslmode=require` connects over TLS. Here rather than in the crate, so
//! that it runs only where tests/run found a Postgres (feature `postgres`).
//!
//! Run with `cargo test -p jobrail-conformance --features postgres --test postgres_connection`.

use std::sync::Arc;
use std::time::Duration;

use jobrail::{Claim, ClaimStore, Job};
use jobrail_native::{MemoryDriver, Producer};
use jobrail_postgres::rustls;
use jobrail_postgres::tokio_postgres::Client;
use jobrail_postgres::{Outbox, OutboxRelay, PgClaims, PgConnect};

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// `url` with one more query parameter.
fn with_param(url: &str, param: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{param}")
}

/// A name no other run uses.
fn unique(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{tag}_{}_{nanos}", std::process::id())
}

/// The test's own plain connection.
async fn admin() -> Client {
    PgConnect::new(&with_param(&database_url(), "sslmode=disable"))
        .unwrap()
        .connect()
        .await
        .unwrap_or_else(|e| panic!("cannot connect to Postgres at DATABASE_URL: {e}"))
}

/// The backend pids of the sessions named `name`.
async fn sessions(admin: &Client, name: &str) -> Vec<i32> {
    admin
        .query(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1",
            &[&name],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// Terminates every session named `name`; how many there were.
async fn terminate(admin: &Client, name: &str) -> usize {
    let pids = sessions(admin, name).await;
    for pid in &pids {
        admin
            .execute("SELECT pg_terminate_backend($1)", &[pid])
            .await
            .unwrap();
    }
    // Until the server has let them go.
    for _ in 0..100 {
        if sessions(admin, name).await.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    pids.len()
}

#[tokio::test]
async fn claims_come_back_after_the_server_closed_the_connection() {
    let admin = admin().await;
    let name = unique("claims_reconnect");
    let table = unique("claims_reconnect");
    let connect = PgConnect::new(&with_param(
        &database_url(),
        &format!("application_name={name}"),
    ))
    .unwrap()
    .reconnect_wait(Duration::from_millis(50), Duration::from_millis(200));
    let claims = PgClaims::connect_to(connect, &table).await.unwrap();
    let lease = Duration::from_secs(30);
    let Claim::Claimed { fence } = claims.claim("before", lease).await.unwrap() else {
        panic!("a new key is claimed");
    };
    let before = sessions(&admin, &name).await;
    assert_eq!(before.len(), 1, "one connection: {before:?}");

    assert_eq!(terminate(&admin, &name).await, 1);
    // The next operations run on a new connection, without an error.
    claims.complete("before", fence).await.unwrap();
    assert!(matches!(
        claims.claim("after", lease).await.unwrap(),
        Claim::Claimed { fence: 1 }
    ));
    assert!(matches!(
        claims.claim("before", lease).await.unwrap(),
        Claim::Done
    ));
    let after = sessions(&admin, &name).await;
    assert_eq!(after.len(), 1, "{after:?}");
    assert_ne!(after, before, "a new session");

    admin
        .batch_execute(&format!("DROP TABLE \"{table}\""))
        .await
        .unwrap();
}

#[tokio::test]
async fn the_relay_comes_back_after_the_server_closed_the_connection() {
    let admin = admin().await;
    let name = unique("relay_reconnect");
    let outbox = Outbox::with_table(unique("relay_reconnect")).unwrap();
    outbox.install(&admin).await.unwrap();
    let job = Job::<u32>::builder("relay-reconnect").build().unwrap();
    let driver = Arc::new(MemoryDriver::default());
    let connect = PgConnect::new(&with_param(
        &database_url(),
        &format!("application_name={name}"),
    ))
    .unwrap()
    .reconnect_wait(Duration::from_millis(50), Duration::from_millis(200));
    let relay = OutboxRelay::new(&connect, outbox.clone(), Producer::new(driver.clone()));

    outbox.dispatch(&admin, &job, &1).await.unwrap();
    assert_eq!(relay.run_once().await.unwrap().sent, 1);
    let before = sessions(&admin, &name).await;
    assert_eq!(terminate(&admin, &name).await, 1);

    outbox.dispatch(&admin, &job, &2).await.unwrap();
    // A pass may find the loss first (and fail); the one after reconnects.
    let mut sent = 0;
    let mut failures = 0;
    for _ in 0..2 {
        match relay.run_once().await {
            Ok(pass) => {
                sent += pass.sent;
                break;
            }
            Err(_) => failures += 1,
        }
    }
    assert_eq!((sent, failures <= 1), (1, true), "failures: {failures}");
    assert_eq!(driver.depth(job.queue()), 2);
    let after = sessions(&admin, &name).await;
    assert_eq!(after.len(), 1);
    assert_ne!(after, before);

    admin
        .batch_execute(&format!("DROP TABLE \"{}\"", outbox.table()))
        .await
        .unwrap();
}

/// Takes any certificate: the test server's is self-signed.
#[derive(Debug)]
struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[tokio::test]
async fn sslmode_require_connects_over_tls() {
    let admin = admin().await;
    let ssl: String = admin.query_one("SHOW ssl", &[]).await.unwrap().get(0);
    let url = with_param(&database_url(), "sslmode=require");
    let platform = PgConnect::new(&url).unwrap().connect().await;
    if ssl != "on" {
        // The server takes no TLS: a required TLS connection must fail, and
        // say so.
        let error = platform.expect_err("no TLS on the server").to_string();
        assert!(error.to_lowercase().contains("tls"), "{error}");
        eprintln!("the test server has ssl off: checked only that sslmode=require refuses plain");
        return;
    }
    // The platform's roots do not hold the test server's self-signed
    // certificate: the certificate was checked, and refused.
    let error = format!("{:?}", platform.expect_err("a self-signed certificate"));
    assert!(
        error.contains("Certificate") || error.contains("certificate"),
        "{error}"
    );

    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
        .with_no_client_auth();
    let name = unique("tls");
    let connect = PgConnect::new(&with_param(&url, &format!("application_name={name}")))
        .unwrap()
        .tls(tls);
    let client = connect.connect().await.unwrap();
    let over_tls: bool = client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(over_tls, "the session runs over TLS");

    // The claims use the same settings.
    let table = unique("claims_tls");
    let claims = PgClaims::connect_to(connect, &table).await.unwrap();
    assert!(matches!(
        claims.claim("k", Duration::from_secs(5)).await.unwrap(),
        Claim::Claimed { fence: 1 }
    ));
    let pids = sessions(&admin, &name).await;
    assert_eq!(pids.len(), 2, "the test's client and the store's: {pids:?}");
    let ssl_sessions: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_stat_ssl WHERE ssl AND pid = ANY($1)",
            &[&pids],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(ssl_sessions, 2);
    admin
        .batch_execute(&format!("DROP TABLE \"{table}\""))
        .await
        .unwrap();
}
