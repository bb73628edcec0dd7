//! Users, roles, HTTP Basic authentication and CSRF tokens.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::{Dashboard, DashboardError};

/// Marks a password given as its digest ([`crate::DashboardBuilder::user_sha256`]).
pub(crate) const DIGEST_MARK: &str = "\u{0}sha256:";

/// What a user may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Role {
    /// Sees every page; changes nothing.
    ReadOnly,
    /// Also replays and purges failure records.
    Operator,
}

impl Role {
    /// `read-only` or `operator`.
    pub fn name(self) -> &'static str {
        match self {
            Role::ReadOnly => "read-only",
            Role::Operator => "operator",
        }
    }

    /// The role named `read-only` (or `readonly`, `viewer`) or `operator`.
    pub fn parse(text: &str) -> Option<Role> {
        match text.trim().to_ascii_lowercase().as_str() {
            "read-only" | "readonly" | "viewer" => Some(Role::ReadOnly),
            "operator" => Some(Role::Operator),
            _ => None,
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

struct Account {
    name: String,
    digest: [u8; 32],
    role: Role,
}

/// The configured users and the CSRF key.
pub(crate) struct Users {
    accounts: Vec<Account>,
    key: Vec<u8>,
}

/// The signed-in user of a request.
#[derive(Debug, Clone)]
pub(crate) struct User {
    pub(crate) name: String,
    pub(crate) role: Role,
    pub(crate) csrf: String,
}

fn digest(text: &str) -> [u8; 32] {
    Sha256::digest(text.as_bytes()).into()
}

fn parse_hex(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Users {
    pub(crate) fn new(
        users: Vec<(String, String, Role)>,
        key: Vec<u8>,
    ) -> Result<Users, DashboardError> {
        let mut accounts: Vec<Account> = Vec::new();
        for (name, password, role) in users {
            if name.is_empty() || name.contains(':') {
                return Err(DashboardError::User(
                    name,
                    "a name must be non-empty and hold no `:`".into(),
                ));
            }
            if accounts.iter().any(|a| a.name == name) {
                return Err(DashboardError::User(name, "configured twice".into()));
            }
            let digest = match password.strip_prefix(DIGEST_MARK) {
                Some(hex) => parse_hex(&hex.to_ascii_lowercase()).ok_or_else(|| {
                    DashboardError::User(
                        name.clone(),
                        "the SHA-256 digest must be 64 hex digits".into(),
                    )
                })?,
                None if password.is_empty() => {
                    return Err(DashboardError::User(name, "the password is empty".into()))
                }
                None => digest(&password),
            };
            accounts.push(Account { name, digest, role });
        }
        Ok(Users { accounts, key })
    }

    /// The user `Authorization: Basic ...` names, when the password matches.
    fn authenticate(&self, headers: &HeaderMap) -> Option<User> {
        let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
        let (scheme, encoded) = value.split_once(' ')?;
        if !scheme.eq_ignore_ascii_case("basic") {
            return None;
        }
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(encoded.trim())
            .ok()?;
        let decoded = String::from_utf8(decoded).ok()?;
        let (name, password) = decoded.split_once(':')?;
        let given = digest(password);
        // Every account is compared, so the time does not tell which
        // names exist.
        let mut found = None;
        for account in &self.accounts {
            let name_matches = account.name.as_bytes().ct_eq(name.as_bytes());
            let password_matches = account.digest.ct_eq(&given);
            if bool::from(name_matches & password_matches) {
                found = Some(account);
            }
        }
        let account = found?;
        Some(User {
            name: account.name.clone(),
            role: account.role,
            csrf: self.csrf_token(&account.name),
        })
    }

    fn csrf_token(&self, name: &str) -> String {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.key).expect("HMAC takes a key of any length");
        mac.update(b"jobrail-web csrf\0");
        mac.update(name.as_bytes());
        to_hex(&mac.finalize().into_bytes())
    }
}

/// Whether a form's token is the user's.
pub(crate) fn csrf_matches(user: &User, token: &str) -> bool {
    user.csrf.len() == token.len() && bool::from(user.csrf.as_bytes().ct_eq(token.as_bytes()))
}

/// Whether a mutation's `Origin` (or, without one, `Sec-Fetch-Site`) says
/// it came from a page of this host.
pub(crate) fn same_origin(headers: &HeaderMap) -> bool {
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    if let Some(origin) = headers.get(header::ORIGIN) {
        let Ok(origin) = origin.to_str() else {
            return false;
        };
        let without_scheme = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"));
        return without_scheme.is_some_and(|o| !host.is_empty() && o == host);
    }
    match headers.get("sec-fetch-site").and_then(|v| v.to_str().ok()) {
        Some(site) => site == "same-origin" || site == "none",
        // Neither header: not a browser's cross-site request (browsers send
        // `Origin` on every cross-site POST); the CSRF token decides.
        None => true,
    }
}

fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [
            (
                header::WWW_AUTHENTICATE,
                "Basic realm=\"jobrail\", charset=\"UTF-8\"",
            ),
            (header::CACHE_CONTROL, "no-store"),
        ],
        "sign in: this dashboard needs a user name and password\n",
    )
        .into_response()
}

/// Refuses every request without a configured user's credentials; hands
/// the user to the pages.
pub(crate) async fn require_user(
    State(dashboard): State<Dashboard>,
    mut request: Request,
    next: Next,
) -> Response {
    match dashboard.inner().users.authenticate(request.headers()) {
        Some(user) => {
            request.extensions_mut().insert(user);
            let mut response = next.run(request).await;
            let headers = response.headers_mut();
            headers.insert(header::CACHE_CONTROL, "no-store".parse().expect("valid"));
            headers.insert("x-frame-options", "DENY".parse().expect("valid"));
            headers.insert("x-content-type-options", "nosniff".parse().expect("valid"));
            headers.insert(
                "content-security-policy",
                "default-src 'self'; frame-ancestors 'none'; form-action 'self'"
                    .parse()
                    .expect("valid"),
            );
            headers.insert("referrer-policy", "same-origin".parse().expect("valid"));
            response
        }
        None => unauthorized(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn users() -> Users {
        Users::new(
            vec![
                ("alice".into(), "pw-a".into(), Role::Operator),
                (
                    "bob".into(),
                    format!("{DIGEST_MARK}{}", to_hex(&digest("pw-b"))),
                    Role::ReadOnly,
                ),
            ],
            vec![7; 32],
        )
        .unwrap()
    }

    fn basic(user: &str, password: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        h.insert(
            header::AUTHORIZATION,
            format!("Basic {token}").parse().unwrap(),
        );
        h
    }

    #[test]
    fn only_configured_users_with_their_passwords_sign_in() {
        let u = users();
        assert_eq!(
            u.authenticate(&basic("alice", "pw-a")).unwrap().role,
            Role::Operator
        );
        assert_eq!(
            u.authenticate(&basic("bob", "pw-b")).unwrap().role,
            Role::ReadOnly
        );
        assert!(u.authenticate(&basic("alice", "pw-b")).is_none());
        assert!(u.authenticate(&basic("carol", "pw-a")).is_none());
        assert!(u.authenticate(&HeaderMap::new()).is_none());
        let mut bearer = HeaderMap::new();
        bearer.insert(header::AUTHORIZATION, "Bearer pw-a".parse().unwrap());
        assert!(u.authenticate(&bearer).is_none());
    }

    #[test]
    fn csrf_tokens_are_per_user_and_per_key() {
        let u = users();
        let alice = u.authenticate(&basic("alice", "pw-a")).unwrap();
        let bob = u.authenticate(&basic("bob", "pw-b")).unwrap();
        assert_ne!(alice.csrf, bob.csrf);
        assert!(csrf_matches(&alice, &alice.csrf.clone()));
        assert!(!csrf_matches(&alice, &bob.csrf));
        assert!(!csrf_matches(&alice, ""));
        let other = Users::new(
            vec![("alice".into(), "pw-a".into(), Role::Operator)],
            vec![8; 32],
        )
        .unwrap();
        assert_ne!(other.csrf_token("alice"), alice.csrf);
    }

    #[test]
    fn bad_users_are_refused() {
        let key = vec![0; 32];
        assert!(Users::new(vec![("".into(), "x".into(), Role::Operator)], key.clone()).is_err());
        assert!(Users::new(
            vec![("a:b".into(), "x".into(), Role::Operator)],
            key.clone()
        )
        .is_err());
        assert!(Users::new(vec![("a".into(), "".into(), Role::Operator)], key.clone()).is_err());
        assert!(Users::new(
            vec![
                ("a".into(), "x".into(), Role::Operator),
                ("a".into(), "y".into(), Role::ReadOnly)
            ],
            key.clone()
        )
        .is_err());
        assert!(Users::new(
            vec![("a".into(), format!("{DIGEST_MARK}abc"), Role::Operator)],
            key
        )
        .is_err());
    }

    #[test]
    fn origins_of_other_hosts_are_refused() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, "ops.example:8080".parse().unwrap());
        assert!(same_origin(&h));
        h.insert(header::ORIGIN, "http://ops.example:8080".parse().unwrap());
        assert!(same_origin(&h));
        h.insert(header::ORIGIN, "https://evil.example".parse().unwrap());
        assert!(!same_origin(&h));
        h.insert(header::ORIGIN, "null".parse().unwrap());
        assert!(!same_origin(&h));
        h.remove(header::ORIGIN);
        h.insert("sec-fetch-site", "cross-site".parse().unwrap());
        assert!(!same_origin(&h));
        h.insert("sec-fetch-site", "same-origin".parse().unwrap());
        assert!(same_origin(&h));
    }

    #[test]
    fn roles_parse() {
        assert_eq!(Role::parse("operator"), Some(Role::Operator));
        assert_eq!(Role::parse("Read-Only"), Some(Role::ReadOnly));
        assert_eq!(Role::parse("admin"), None);
    }
}
