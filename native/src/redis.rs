//! Redis: claims that run an effect once ([`RedisClaims`]).

/// Claims on Redis (being built).
#[derive(Debug)]
pub struct RedisClaims;
