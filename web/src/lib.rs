//! The jobrail dashboard: a web page for operators in front of the failure
//! stores, queue depths, failure budgets, tier resolutions, breakers and
//! schedules of native workers and of Cloudflare edge workers.
//!
//! [`Dashboard`] is an [`axum::Router`] an application mounts in its own
//! server (`jobrail serve` runs one on its own). Pages are rendered on the
//! server; a small script (select all, auto-refresh) is the only
//! JavaScript, and every asset is compiled into the binary.
//!
//! - **Overview**: every queue of every source with ready / in flight /
//!   delayed (where the backend reports them) and its failure records, the
//!   settlements of the last 1, 5 and 15 minutes (succeeded, retried,
//!   failed, rejected) and each breaker's state.
//! - **Jobs**: each registered job's policy, failure budget (N x M, worst
//!   time to failure) and which tier resolved its successes.
//! - **Failures**: a paged list with filters (job, failure kind, age, text
//!   in the reason), a record's page (the payload only when
//!   [`DashboardBuilder::show_payloads`] opted in), replay and purge of one
//!   record, of the selection or of every record matching the filter, each
//!   behind a confirmation.
//! - **Schedules**: each schedule's cron, zone, policies, next ticks and
//!   whether its latest ticks fired.
//!
//! # Access
//!
//! No page is served without credentials: [`DashboardBuilder::build`]
//! refuses a dashboard without users. Each user has a [`Role`]:
//! [`Role::ReadOnly`] sees every page and no control that changes
//! anything (and is refused one sent by hand, 403); [`Role::Operator`]
//! replays and purges. Requests authenticate with HTTP Basic. Every
//! mutation is a `POST` carrying the user's CSRF token (an HMAC of the
//! user's name under a key of the dashboard's) and, when the browser sends
//! one, an `Origin` of the dashboard's own host; anything else is refused
//! (403). Each mutation writes an audit line (target `jobrail_web::audit`:
//! who, what, where, how many), never a payload.
//!
//! # Example
//!
//! ```
//! use std::sync::Arc;
//! use jobrail::{Job, JobContext, Registry};
//! use jobrail_native::MemoryDriver;
//! use jobrail_web::{Dashboard, Role, Source};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let job = Job::<u32>::builder("invoice").queue("billing").build()?;
//! let mut registry = Registry::new();
//! registry.register(&job, |_ctx: JobContext, _n: u32| async move { Ok(()) })?;
//! let driver = Arc::new(MemoryDriver::default());
//!
//! let dashboard = Dashboard::builder()
//!     .user("alice", "a long random password", Role::Operator)
//!     .user("bob", "another one", Role::ReadOnly)
//!     .source(Source::native("workers", driver).registry(&registry))
//!     .base_path("/ops")
//!     .build()?;
//! // Mounted under the same path in the application's own server.
//! let app: axum::Router = axum::Router::new().nest("/ops", dashboard.router());
//! # let _ = app;
//! # Ok(())
//! # }
//! ```

mod activity;
mod auth;
mod edge;
mod html;
mod pages;
mod source;

use std::sync::Arc;

use axum::routing::{get, post};
use axum::Router;

pub use auth::Role;
pub use source::Source;

use crate::activity::Activity;
use crate::auth::Users;

/// A dashboard configuration that cannot be served.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DashboardError {
    /// No user was configured: the dashboard serves no page without
    /// credentials.
    #[error("the dashboard has no users: add one with DashboardBuilder::user (no page is served without credentials)")]
    NoUsers,
    /// A user is configured twice, or has an empty name or password.
    #[error("user `{0}`: {1}")]
    User(String, String),
    /// No source was given, or two sources share a name.
    #[error("sources: {0}")]
    Sources(String),
    /// The base path is not `""` or `/segment[/segment...]`.
    #[error("base path `{0}`: it must be empty or start with `/` and not end with one")]
    BasePath(String),
    /// The CSRF key is shorter than 32 bytes.
    #[error("the CSRF key must be at least 32 bytes")]
    CsrfKey,
}

/// The dashboard: build it with [`Dashboard::builder`], serve
/// [`Dashboard::router`].
#[derive(Clone)]
pub struct Dashboard {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) users: Users,
    pub(crate) sources: Vec<Source>,
    pub(crate) base: String,
    pub(crate) show_payloads: bool,
    pub(crate) title: String,
    pub(crate) activity: Activity,
}

impl std::fmt::Debug for Dashboard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dashboard")
            .field("base", &self.inner.base)
            .field(
                "sources",
                &self
                    .inner
                    .sources
                    .iter()
                    .map(Source::name)
                    .collect::<Vec<_>>(),
            )
            .field("show_payloads", &self.inner.show_payloads)
            .finish_non_exhaustive()
    }
}

impl Dashboard {
    /// A dashboard to configure.
    pub fn builder() -> DashboardBuilder {
        DashboardBuilder {
            users: Vec::new(),
            sources: Vec::new(),
            base: String::new(),
            show_payloads: false,
            title: "jobrail".to_string(),
            csrf_key: None,
        }
    }

    /// The pages and their assets, to serve or to [`nest`](Router::nest)
    /// under the [base path](DashboardBuilder::base_path).
    ///
    /// The overview's settlement rates are sampled every 10 seconds by a
    /// task started here (on the current tokio runtime) and stopped when
    /// the last clone of the router is dropped.
    pub fn router(&self) -> Router {
        self.inner.activity.start(&self.inner.sources);
        let state = self.clone();
        Router::new()
            .route("/", get(pages::overview))
            .route("/jobs", get(pages::jobs))
            .route("/failures", get(pages::failures))
            .route("/failures/record", get(pages::record))
            .route("/failures/action", post(pages::action))
            .route("/schedules", get(pages::schedules))
            .route("/assets/style.css", get(pages::style))
            .route("/assets/app.js", get(pages::script))
            .route("/assets/favicon.svg", get(pages::icon))
            .route("/favicon.ico", get(pages::icon))
            .layer(axum::middleware::from_fn_with_state(
                state.clone(),
                auth::require_user,
            ))
            .with_state(state)
    }

    pub(crate) fn inner(&self) -> &Inner {
        &self.inner
    }
}

/// Configures a [`Dashboard`].
#[derive(Debug)]
pub struct DashboardBuilder {
    users: Vec<(String, String, Role)>,
    sources: Vec<Source>,
    base: String,
    show_payloads: bool,
    title: String,
    csrf_key: Option<Vec<u8>>,
}

impl DashboardBuilder {
    /// A user who may sign in with `password`, in `role`.
    pub fn user(
        mut self,
        name: impl Into<String>,
        password: impl Into<String>,
        role: Role,
    ) -> Self {
        self.users.push((name.into(), password.into(), role));
        self
    }

    /// A user whose password is given as its SHA-256 digest in lowercase
    /// hex (a users file need not hold passwords).
    pub fn user_sha256(
        mut self,
        name: impl Into<String>,
        sha256_hex: impl Into<String>,
        role: Role,
    ) -> Self {
        self.users.push((
            name.into(),
            format!("{}{}", auth::DIGEST_MARK, sha256_hex.into()),
            role,
        ));
        self
    }

    /// A backend to show: native workers' driver or an edge worker's
    /// failure keeper. Shown in the order given.
    pub fn source(mut self, source: Source) -> Self {
        self.sources.push(source);
        self
    }

    /// The path the router is mounted at (`/ops`; default: the root), for
    /// the links in the pages.
    pub fn base_path(mut self, path: impl Into<String>) -> Self {
        self.base = path.into();
        self
    }

    /// Shows records' payloads on their pages (default: hidden, as events
    /// leave them out unless the application opts in: they may hold
    /// personal data or secrets).
    pub fn show_payloads(mut self, show: bool) -> Self {
        self.show_payloads = show;
        self
    }

    /// The name in the page header (default `jobrail`).
    pub fn title(mut self, title: impl Into<String>) -> Self {
        self.title = title.into();
        self
    }

    /// The key CSRF tokens are derived with (at least 32 bytes). Default: a
    /// random key per process; give one shared key to replicas behind one
    /// address, so a form from one is accepted by another.
    pub fn csrf_key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.csrf_key = Some(key.into());
        self
    }

    /// The dashboard, or why it cannot be served.
    pub fn build(self) -> Result<Dashboard, DashboardError> {
        if self.users.is_empty() {
            return Err(DashboardError::NoUsers);
        }
        if self.sources.is_empty() {
            return Err(DashboardError::Sources(
                "no source: add one with DashboardBuilder::source".into(),
            ));
        }
        let mut names = std::collections::BTreeSet::new();
        for s in &self.sources {
            if s.name().is_empty() || !names.insert(s.name().to_string()) {
                return Err(DashboardError::Sources(format!(
                    "two sources are named `{}` (or a name is empty)",
                    s.name()
                )));
            }
        }
        let base = self.base;
        if !base.is_empty() && (!base.starts_with('/') || base.ends_with('/')) {
            return Err(DashboardError::BasePath(base));
        }
        let key = match self.csrf_key {
            Some(k) if k.len() < 32 => return Err(DashboardError::CsrfKey),
            Some(k) => k,
            None => {
                let mut k = Vec::with_capacity(32);
                k.extend_from_slice(uuid::Uuid::new_v4().as_bytes());
                k.extend_from_slice(uuid::Uuid::new_v4().as_bytes());
                k
            }
        };
        let users = Users::new(self.users, key)?;
        Ok(Dashboard {
            inner: Arc::new(Inner {
                users,
                activity: Activity::default(),
                sources: self.sources,
                base,
                show_payloads: self.show_payloads,
                title: self.title,
            }),
        })
    }
}
