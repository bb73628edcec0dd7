//! The dashboard's router in-process (tower's `oneshot`): what a browser
//! test would take minutes to cover for every case: credentials, roles,
//! CSRF and origin checks, confirmation, paging, filters, escaping, bulk
//! replay and purge, and configurations refused.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use jobrail::{Job, JobContext, JobError, Registry};
use jobrail_native::{Consumer, Driver, Failures, MemoryDriver, Producer};
use jobrail_web::{Dashboard, DashboardError, Role, Source};
use tower::ServiceExt;

const ALICE: &str = "Basic YWxpY2U6cHctYQ=="; // alice:pw-a
const BOB: &str = "Basic Ym9iOnB3LWI="; // bob:pw-b

/// A memory driver with `n` failure records on `reports`, reasons
/// `record {i}: ...` (the 7th one's reason holds markup).
async fn failed(n: u32) -> Arc<MemoryDriver> {
    let driver = Arc::new(MemoryDriver::default());
    let job = Job::<u32>::builder("send")
        .queue("reports")
        .max_deliveries(1)
        .build()
        .unwrap();
    let mut registry = Registry::new();
    registry
        .register(&job, |ctx: JobContext, i: u32| async move {
            if ctx.metadata().contains_key(jobrail::REPLAY_OF) {
                return Ok(());
            }
            if i == 7 {
                return Err(JobError::permanent(
                    "<script>alert('x')</script> in the template",
                ));
            }
            Err(JobError::permanent(format!(
                "record {i}: the address bounced"
            )))
        })
        .unwrap();
    let producer = Producer::new(driver.clone());
    let payloads: Vec<u32> = (0..n).collect();
    for sent in producer.dispatch(&job).send_batch(&payloads).await {
        sent.unwrap();
    }
    let consumer = Consumer::builder(driver.clone(), registry).build().spawn();
    while driver.failure_records("reports").len() < n as usize {
        tokio::task::yield_now().await;
    }
    consumer.shutdown().await.unwrap();
    driver
}

fn dashboard(driver: Arc<MemoryDriver>) -> axum::Router {
    Dashboard::builder()
        .user("alice", "pw-a", Role::Operator)
        .user("bob", "pw-b", Role::ReadOnly)
        .source(Source::native("workers", driver).queue("reports"))
        .build()
        .unwrap()
        .router()
}

async fn call(
    router: &axum::Router,
    request: Request<Body>,
) -> (StatusCode, String, Option<String>) {
    let response = router.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let location = response
        .headers()
        .get(header::LOCATION)
        .map(|l| l.to_str().unwrap().to_string());
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (
        status,
        String::from_utf8_lossy(&body).into_owned(),
        location,
    )
}

fn get(path: &str, auth: Option<&str>) -> Request<Body> {
    let mut r = Request::get(path);
    if let Some(a) = auth {
        r = r.header(header::AUTHORIZATION, a);
    }
    r.body(Body::empty()).unwrap()
}

fn post(form: &str, auth: &str, origin: Option<&str>) -> Request<Body> {
    let mut r = Request::post("/failures/action")
        .header(header::AUTHORIZATION, auth)
        .header(header::HOST, "ops.test")
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
    if let Some(o) = origin {
        r = r.header(header::ORIGIN, o);
    }
    r.body(Body::from(form.to_string())).unwrap()
}

fn csrf(html: &str) -> String {
    let at = html.find("name=\"csrf\" value=\"").expect("a csrf field") + 19;
    html[at..at + 64].to_string()
}

fn rows(html: &str) -> usize {
    html.matches("<tr data-id=").count()
}

#[tokio::test]
async fn every_page_needs_credentials() {
    let router = dashboard(failed(1).await);
    for path in [
        "/",
        "/jobs",
        "/failures",
        "/failures/record?id=x",
        "/schedules",
        "/assets/style.css",
    ] {
        let (status, _, _) = call(&router, get(path, None)).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{path}");
        let (status, _, _) = call(&router, get(path, Some("Basic YWxpY2U6bm9wZQ=="))).await;
        assert_eq!(
            status,
            StatusCode::UNAUTHORIZED,
            "{path} with a wrong password"
        );
    }
    let (status, _, _) = call(
        &router,
        post("do=purge-matching&confirm=yes", "Basic eDp5", None),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    for path in [
        "/",
        "/jobs",
        "/failures",
        "/schedules",
        "/assets/style.css",
        "/assets/app.js",
    ] {
        let (status, _, _) = call(&router, get(path, Some(BOB))).await;
        assert_eq!(status, StatusCode::OK, "{path}");
    }
}

#[tokio::test]
async fn pages_filters_and_markup_in_reasons() {
    let router = dashboard(failed(120).await);
    let (_, page1, _) = call(&router, get("/failures?queue=reports", Some(ALICE))).await;
    assert_eq!(rows(&page1), 50);
    assert!(
        page1.contains("<strong id=\"matched\">120</strong>"),
        "{page1}"
    );
    let (_, page3, _) = call(&router, get("/failures?queue=reports&page=3", Some(ALICE))).await;
    assert_eq!(rows(&page3), 20);
    let (_, beyond, _) = call(&router, get("/failures?queue=reports&page=99", Some(ALICE))).await;
    assert_eq!(rows(&beyond), 20, "a page past the last shows the last");
    let (_, found, _) = call(
        &router,
        get("/failures?queue=reports&q=record+11%3A", Some(ALICE)),
    )
    .await;
    assert_eq!(rows(&found), 1);
    let (_, kind, _) = call(
        &router,
        get(
            "/failures?queue=reports&kind=attempts_exhausted",
            Some(ALICE),
        ),
    )
    .await;
    assert_eq!(rows(&kind), 0);
    let (_, job, _) = call(
        &router,
        get("/failures?queue=reports&job=other", Some(ALICE)),
    )
    .await;
    assert_eq!(rows(&job), 0);
    // A reason is the handler's text: shown, never run.
    let (_, markup, _) = call(
        &router,
        get("/failures?queue=reports&q=template", Some(ALICE)),
    )
    .await;
    assert_eq!(rows(&markup), 1);
    assert!(!markup.contains("<script>alert"), "{markup}");
    assert!(markup.contains("&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;"));
    // No inline script or style: the policy forbids them.
    assert!(!markup.contains("style=\"") && !markup.contains("<script>"));
    let response = router.clone().oneshot(get("/", Some(ALICE))).await.unwrap();
    let policy = response.headers()["content-security-policy"]
        .to_str()
        .unwrap();
    assert!(policy.contains("default-src 'self'"), "{policy}");
}

#[tokio::test]
async fn mutations_need_the_operator_the_token_and_this_origin_then_a_confirmation() {
    let driver = failed(30).await;
    let router = dashboard(driver.clone());
    let (_, html, _) = call(&router, get("/failures?queue=reports", Some(ALICE))).await;
    let token = csrf(&html);
    let (_, bob_page, _) = call(&router, get("/failures?queue=reports", Some(BOB))).await;
    assert!(!bob_page.contains("data-mutation") && !bob_page.contains("name=\"csrf\""));
    let purge_all = format!("csrf={token}&do=purge-matching&queue=reports&confirm=yes");
    for (form, auth, origin, what) in [
        (purge_all.as_str(), BOB, None, "the read-only role"),
        (
            "do=purge-matching&queue=reports&confirm=yes",
            ALICE,
            None,
            "no token",
        ),
        (
            &*format!(
                "csrf={}&do=purge-matching&queue=reports&confirm=yes",
                "0".repeat(64)
            ),
            ALICE,
            None,
            "a wrong token",
        ),
        (
            purge_all.as_str(),
            ALICE,
            Some("https://elsewhere.test"),
            "another origin",
        ),
    ] {
        let (status, _, _) = call(&router, post(form, auth, origin)).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{what}");
    }
    assert_eq!(
        Failures::new(driver.clone())
            .all("reports")
            .await
            .unwrap()
            .len(),
        30
    );

    // Without confirm=yes: the confirmation, nothing done.
    let ask = format!("csrf={token}&do=replay-matching&queue=reports&q=bounced");
    let (status, confirm, _) = call(&router, post(&ask, ALICE, Some("http://ops.test"))).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        confirm.contains("id=\"confirm\"") && confirm.contains("29"),
        "{confirm}"
    );
    assert_eq!(
        Failures::new(driver.clone())
            .all("reports")
            .await
            .unwrap()
            .len(),
        30
    );

    // Confirmed: 29 replayed (the markup one does not match), 1 left.
    let (status, _, location) = call(
        &router,
        post(
            &format!("{ask}&confirm=yes"),
            ALICE,
            Some("http://ops.test"),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert!(location.unwrap().contains("Replayed+29+of+29"));
    let left = Failures::new(driver.clone()).all("reports").await.unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(
        driver.depth("reports"),
        29,
        "the replays wait in the work queue"
    );

    // A selection purged by id.
    let id = left[0].id.clone();
    let form = format!("csrf={token}&do=purge-selected&queue=reports&id={id}&confirm=yes");
    let (_, _, location) = call(&router, post(&form, ALICE, None)).await;
    assert!(location.unwrap().contains("Purged+1+of+1"));
    assert!(Failures::new(driver.clone())
        .all("reports")
        .await
        .unwrap()
        .is_empty());
    // Nothing selected: said, nothing done.
    let (status, _, _) = call(
        &router,
        post(
            &format!("csrf={token}&do=purge-selected&queue=reports&confirm=yes"),
            ALICE,
            None,
        ),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn a_record_page_hides_the_payload_unless_enabled() {
    let driver = failed(1).await;
    let id = Failures::new(driver.clone()).all("reports").await.unwrap()[0]
        .id
        .clone();
    let path = format!("/failures/record?queue=reports&id={id}");
    let (status, hidden, _) = call(&dashboard(driver.clone()), get(&path, Some(BOB))).await;
    assert_eq!(status, StatusCode::OK);
    assert!(hidden.contains("id=\"payload-hidden\"") && !hidden.contains("id=\"payload\""));
    assert!(
        !hidden.contains("data-mutation"),
        "no replay for the read-only role"
    );
    let shown = Dashboard::builder()
        .user("bob", "pw-b", Role::ReadOnly)
        .source(Source::native("workers", driver.clone() as Arc<dyn Driver>).queue("reports"))
        .show_payloads(true)
        .build()
        .unwrap()
        .router();
    let (_, page, _) = call(&shown, get(&path, Some(BOB))).await;
    assert!(page.contains("id=\"payload\""), "{page}");
    let (status, _, _) = call(
        &dashboard(driver),
        get("/failures/record?queue=reports&id=nope", Some(BOB)),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[test]
fn configurations_that_cannot_be_served_are_refused() {
    let driver: Arc<dyn Driver> = Arc::new(MemoryDriver::default());
    let source = || Source::native("workers", driver.clone());
    assert!(matches!(
        Dashboard::builder().source(source()).build(),
        Err(DashboardError::NoUsers)
    ));
    let one = || Dashboard::builder().user("a", "pw", Role::Operator);
    assert!(matches!(one().build(), Err(DashboardError::Sources(_))));
    assert!(matches!(
        one().source(source()).source(source()).build(),
        Err(DashboardError::Sources(_))
    ));
    assert!(matches!(
        one().source(source()).base_path("ops").build(),
        Err(DashboardError::BasePath(_))
    ));
    assert!(matches!(
        one().source(source()).base_path("/ops/").build(),
        Err(DashboardError::BasePath(_))
    ));
    assert!(matches!(
        one().source(source()).csrf_key(vec![1; 8]).build(),
        Err(DashboardError::CsrfKey)
    ));
    assert!(matches!(
        one()
            .user("a", "other", Role::ReadOnly)
            .source(source())
            .build(),
        Err(DashboardError::User(..))
    ));
    assert!(one().source(source()).base_path("/ops").build().is_ok());
}
