//! The RabbitMQ driver over TLS (`amqps://`), against the local broker
//! behind a TLS-terminating proxy whose certificate a throwaway CA signs:
//! the whole conformance suite runs through it with the CA given in
//! [`RabbitConfig::ca_certificates`], and a driver that does not trust the
//! CA is refused with a clear error.
//!
//! Run with `cargo test -p jobrail-conformance --features rabbitmq-tls --test rabbitmq_tls`.
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use jobrail_conformance::fixture::{Fixture, RabbitMq};
use jobrail_conformance::harness::outgoing;
use jobrail_native::rabbitmq::{RabbitConfig, RabbitDriver};
use jobrail_native::{Driver, ErrorKind};
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};

/// Small buckets, as in the plain suite.
const BUCKETS_MS: &[u64] = &[50, 100, 250, 500, 1000, 2000, 5000];

/// The broker behind the proxy (`RABBITMQ_ADDR`, default `127.0.0.1:5672`).
fn broker() -> String {
    std::env::var("RABBITMQ_ADDR").unwrap_or_else(|_| "127.0.0.1:5672".into())
}

/// A TLS listener on loopback that forwards every connection to the broker.
struct TlsProxy {
    port: u16,
    /// The CA that signed the proxy's certificate, PEM.
    ca_pem: String,
}

/// One proxy for the whole test binary, on its own thread and runtime (each
/// test has a runtime of its own that ends with it).
fn proxy() -> &'static TlsProxy {
    static PROXY: OnceLock<TlsProxy> = OnceLock::new();
    PROXY.get_or_init(|| {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "queue conformance test CA");
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
            .unwrap()
            .signed_by(&key, &ca, &ca_key)
            .unwrap();
        let server = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
        .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                while let Ok((inbound, _)) = listener.accept().await {
                    let acceptor = acceptor.clone();
                    tokio::spawn(async move {
                        // A client that refuses the certificate ends here.
                        let Ok(mut inbound) = acceptor.accept(inbound).await else {
                            return;
                        };
                        let Ok(mut outbound) = tokio::net::TcpStream::connect(broker()).await
                        else {
                            return;
                        };
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    });
                }
            });
        });
        TlsProxy {
            port,
            ca_pem: ca.pem(),
        }
    })
}

/// `amqps://` to the proxy, without the CA.
fn untrusting_config() -> RabbitConfig {
    let mut config = RabbitConfig::new(format!(
        "amqps://guest:guest@localhost:{}/%2f",
        proxy().port
    ))
    .delay_buckets(BUCKETS_MS.iter().map(|ms| Duration::from_millis(*ms)));
    config.connection_name = "conformance-tls".into();
    config.refused_hold = Duration::from_secs(1);
    // The size scenarios send messages about the limit: 1 MiB, not the
    // broker's 128 MiB (a 100 MiB body is a test of tests/rabbitmq_extra.rs).
    config.max_message_bytes = 1 << 20;
    config
}

/// `amqps://` to the proxy, trusting its CA.
fn config() -> RabbitConfig {
    untrusting_config().ca_certificates(proxy().ca_pem.clone())
}

jobrail_conformance::conformance_suite!(
    Fixture::<RabbitMq>::new(config());
    extra: untrusted_certificate_is_refused
);

/// Without the CA, the platform's roots do not vouch for the proxy: the
/// dispatch is not accepted and the error says why.
async fn untrusted_certificate_is_refused() {
    let driver = RabbitDriver::new(untrusting_config()).unwrap();
    let err = driver
        .send("tls-untrusted", outgoing("a", None))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotAccepted, "{err}");
    let message = err.to_string().to_lowercase();
    assert!(message.contains("certificate"), "{err}");
    assert!(
        !message.contains("guest:guest"),
        "the password is hidden: {err}"
    );
}
