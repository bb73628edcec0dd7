//! A Worker's own HTTP routes, off until the operator turns them on: the
//! bearer-token rule every route of the crate follows ([`Access`]), and
//! `send` (wasm32), the route that dispatches a job through a producer
//! binding, which the template worker serves as `POST /send`.
//!
//! Why off by default: a deployed queue consumer needs no HTTP route, and a
//! route that enqueues work is one nobody should reach by accident. So a
//! route answers 404, as if it did not exist, until its secret is set
//! (`wrangler secret put NAME`, or `.dev.vars` under `wrangler dev`), and
//! 401 to a request without `Authorization: Bearer <that secret>`. The
//! comparison takes the same time whatever the token sent.

/// What a request may do with a route guarded by a secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// The secret is not set (or empty): the route is off, 404.
    Off,
    /// The secret is set but the request does not carry it: 401.
    Denied,
    /// The request carries `Authorization: Bearer <secret>`.
    Allowed,
}

impl Access {
    /// The rule, given the secret's value (`None`: unset) and the request's
    /// `Authorization` header (`None`: absent).
    pub fn of(secret: Option<&str>, authorization: Option<&str>) -> Access {
        let Some(secret) = secret.filter(|s| !s.is_empty()) else {
            return Access::Off;
        };
        let expected = format!("Bearer {secret}");
        if constant_time_eq(
            authorization.unwrap_or_default().as_bytes(),
            expected.as_bytes(),
        ) {
            Access::Allowed
        } else {
            Access::Denied
        }
    }

    /// The refusal's status and text, `None` when allowed.
    pub fn refusal(self) -> Option<(u16, &'static str)> {
        match self {
            Access::Off => Some((404, "not found")),
            Access::Denied => Some((401, "unauthorized")),
            Access::Allowed => None,
        }
    }
}

/// Equality whose time depends only on the lengths.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(target_arch = "wasm32")]
mod worker_routes {
    use jobrail::Job;
    use serde::de::DeserializeOwned;
    use serde::Serialize;
    use worker::{Env, Request, Response};

    use super::Access;
    use crate::EdgeProducer;

    impl Access {
        /// The rule for `req` against the secret named `secret` in `env`.
        pub fn check(req: &Request, env: &Env, secret: &str) -> Access {
            let value = env.secret(secret).ok().map(|s| s.to_string());
            let header = req.headers().get("Authorization").ok().flatten();
            Access::of(value.as_deref(), header.as_deref())
        }
    }

    /// The refusal as a JSON response, `None` when allowed.
    pub fn refused(access: Access) -> Option<worker::Result<Response>> {
        let (status, text) = access.refusal()?;
        Some(
            Response::from_json(&serde_json::json!({ "error": text }))
                .map(|r| r.with_status(status)),
        )
    }

    /// `POST /send`: dispatches the request's payloads as `job` through the
    /// producer binding `binding`, behind the secret `secret` ([`Access`]).
    /// The body is one payload or a JSON array of them; the answer is
    /// `{"ids": [...]}`, the message ids in order. A body that does not
    /// decode as the job's payload is 400; a send the platform refuses is
    /// 502, with the error (nothing of the payload).
    pub async fn send<P>(
        mut req: Request,
        env: &Env,
        secret: &str,
        binding: &str,
        job: &Job<P>,
    ) -> worker::Result<Response>
    where
        P: Serialize + DeserializeOwned,
    {
        if let Some(refusal) = refused(Access::check(&req, env, secret)) {
            return refusal;
        }
        let error = |status: u16, text: String| {
            Response::from_json(&serde_json::json!({ "error": text }))
                .map(|r| r.with_status(status))
        };
        let text = req.text().await?;
        let payloads: Vec<P> = match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(serde_json::Value::Array(items)) => {
                match items.into_iter().map(serde_json::from_value).collect() {
                    Ok(payloads) => payloads,
                    Err(e) => return error(400, format!("not a `{}` payload: {e}", job.name())),
                }
            }
            Ok(one) => match serde_json::from_value(one) {
                Ok(payload) => vec![payload],
                Err(e) => return error(400, format!("not a `{}` payload: {e}", job.name())),
            },
            Err(e) => return error(400, format!("not JSON: {e}")),
        };
        let producer = match EdgeProducer::from_env(env, binding) {
            Ok(producer) => producer,
            Err(e) => return error(500, e.to_string()),
        };
        match producer.dispatch(job).send_batch(&payloads).await {
            Ok(ids) => Response::from_json(&serde_json::json!({ "ids": ids })),
            Err(e) => error(502, e.to_string()),
        }
    }
}

#[cfg(target_arch = "wasm32")]
pub use worker_routes::{refused, send};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_without_the_secret_denied_without_the_token() {
        assert_eq!(Access::of(None, Some("Bearer x")), Access::Off);
        assert_eq!(Access::of(Some(""), Some("Bearer ")), Access::Off);
        assert_eq!(Access::of(Some("s3cret"), None), Access::Denied);
        assert_eq!(
            Access::of(Some("s3cret"), Some("Bearer wrong")),
            Access::Denied
        );
        assert_eq!(Access::of(Some("s3cret"), Some("s3cret")), Access::Denied);
        assert_eq!(
            Access::of(Some("s3cret"), Some("Bearer s3cret")),
            Access::Allowed
        );
        assert_eq!(Access::Off.refusal(), Some((404, "not found")));
        assert_eq!(Access::Denied.refusal(), Some((401, "unauthorized")));
        assert_eq!(Access::Allowed.refusal(), None);
    }
}
