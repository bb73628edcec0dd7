//! The charging job: a handler that runs each scripted execution inside
//! [`jobrail::run_once`] on its message's business key, and the claim store
//! it goes through, which writes every operation and answer to the trace.
//!
//! The store is the real [`jobrail::MemoryClaims`] of the run's [`World`], on
//! the simulation's clock, shared by every consumer incarnation and edge
//! instance as a database would be. The charge happens when a claimed
//! execution's script step succeeds: the ledger records it at that instant
//! ([`Ev::Effect`]), and the completion follows with no await in between, so
//! effect and completion are atomic here as Postgres's `complete_in` makes
//! them in production. A handler whose worker is killed, or whose consumer
//! or edge instance crashes, mid-effect stops there: its claim is left to its
//! lease. At the edge nothing of a crashed instance reaches the store or the
//! ledger (an operation polled after the crash never happened).

use std::sync::Arc;
use std::time::Duration;

use jobrail::{
    run_once, BoxFuture, CircuitBreaker, Claim, ClaimError, ClaimHeld, ClaimStore, JobContext,
    JobError, Once, MIN_HELD_RETRY,
};

use crate::cloudflare::{crash, frozen};
use crate::model::{ClaimAnswer, ClaimOp, Eff, Ev, Semantics, World};
use crate::scenario::{
    begin, delivery_of, result, run_step, Payload, Step, PANIC_BEFORE, PANIC_INSIDE,
};

/// The run's claim store, as one handler execution sees it: every operation
/// and its answer go to the trace under the execution's message and delivery.
struct Recorded {
    world: Arc<World>,
    n: u64,
    delivery: Option<u64>,
}

impl Recorded {
    fn log(&self, key: &str, op: ClaimOp, answer: ClaimAnswer) {
        let mut st = self.world.lock();
        self.world.log(
            &mut st,
            Some(self.n),
            Ev::Claim {
                delivery: self.delivery,
                key: key.to_owned(),
                op,
                answer,
            },
        );
    }
}

fn answer_of(answer: &Result<(), ClaimError>) -> ClaimAnswer {
    match answer {
        Ok(()) => ClaimAnswer::Ok,
        Err(ClaimError::Lost { .. }) => ClaimAnswer::Lost,
        Err(e) => ClaimAnswer::Error(e.to_string()),
    }
}

impl ClaimStore for Recorded {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Claim, ClaimError>> {
        Box::pin(async move {
            if frozen() {
                return std::future::pending().await;
            }
            let answer = self.world.claims.claim(key, lease).await;
            let seen = match &answer {
                Ok(Claim::Claimed { fence }) => ClaimAnswer::Claimed(*fence),
                Ok(Claim::Done) => ClaimAnswer::Done,
                Ok(Claim::Held { remaining }) => ClaimAnswer::Held(*remaining),
                Err(e) => ClaimAnswer::Error(e.to_string()),
            };
            self.log(key, ClaimOp::Claim(lease), seen);
            answer
        })
    }

    fn complete<'a>(&'a self, key: &'a str, fence: u64) -> BoxFuture<'a, Result<(), ClaimError>> {
        Box::pin(async move {
            if frozen() {
                return std::future::pending().await;
            }
            let answer = self.world.claims.complete(key, fence).await;
            self.log(key, ClaimOp::Complete(fence), answer_of(&answer));
            answer
        })
    }

    fn release<'a>(&'a self, key: &'a str, fence: u64) -> BoxFuture<'a, Result<(), ClaimError>> {
        Box::pin(async move {
            if frozen() {
                return std::future::pending().await;
            }
            let answer = self.world.claims.release(key, fence).await;
            self.log(key, ClaimOp::Release(fence), answer_of(&answer));
            answer
        })
    }

    fn extend<'a>(
        &'a self,
        key: &'a str,
        fence: u64,
        lease: Duration,
    ) -> BoxFuture<'a, Result<(), ClaimError>> {
        // `run_once` never extends.
        self.world.claims.extend(key, fence, lease)
    }
}

/// One execution of the charging job's handler for `p`: claim its key for
/// `lease`, and run the next script step as the effect if the claim is this
/// execution's. An execution that finds the key done or held runs no step;
/// the trace shows it as an execution of its own (`Claim(Done)`,
/// `Claim(Held(..))`), with the outcome the claim's answer gives.
pub(crate) fn handler(
    world: Arc<World>,
    ctx: JobContext,
    p: Payload,
    lease: Duration,
    breaker: CircuitBreaker,
    timeout: Option<Duration>,
) -> BoxFuture<'static, Result<(), JobError>> {
    if world.sem == Semantics::Cloudflare && frozen() {
        // The instance has crashed: nothing more runs in it.
        return Box::pin(std::future::pending());
    }
    Box::pin(async move {
        let n = p.n;
        let key = p.key.expect("a charging job's message carries a key");
        let delivery = delivery_of(&world.lock(), n, &ctx);
        let store = Recorded {
            world: world.clone(),
            n,
            delivery,
        };
        let (w, c, k) = (world.clone(), ctx.clone(), key.clone());
        let once = run_once(&store, &key, lease, move |fence| {
            effect(w, c, n, k, fence, breaker, timeout)
        })
        .await;
        let skipped = match &once {
            Ok(Once::Ran(())) => None,
            Ok(Once::AlreadyDone) => Some(("Claim(Done)".to_string(), Eff::Ok)),
            Err(e) => e.find::<ClaimHeld>().map(|held| {
                (
                    format!("Claim(Held({:?}))", held.remaining),
                    Eff::RetryAfter(held.remaining.max(MIN_HELD_RETRY)),
                )
            }),
        };
        if let Some((step, eff)) = skipped {
            let mut st = world.lock();
            if world.sem == Semantics::Cloudflare {
                if let Some(d) = delivery {
                    World::cf_consumed(&mut st, d, None);
                }
            }
            world.log(
                &mut st,
                Some(n),
                Ev::Exec {
                    delivery,
                    attempt: ctx.attempt(),
                    in_process: ctx.in_process_attempt(),
                    step,
                },
            );
            world.log(&mut st, Some(n), Ev::ExecResult { delivery, eff });
        }
        once.map(|_| ())
    })
}

/// The effect under the claim `fence`: the next script step, run as the
/// plain handler runs it; the charge is recorded if it succeeds.
fn effect(
    world: Arc<World>,
    ctx: JobContext,
    n: u64,
    key: String,
    fence: u64,
    breaker: CircuitBreaker,
    timeout: Option<Duration>,
) -> BoxFuture<'static, Result<(), JobError>> {
    let edge = world.sem == Semantics::Cloudflare;
    let (step, delivery) = begin(&world, n, &ctx);
    match step {
        Step::KillsWorker => {
            return Box::pin(async move {
                if edge {
                    crash(delivery, None);
                } else {
                    world.request_crash();
                }
                std::future::pending().await
            });
        }
        Step::PanicBefore => {
            result(&world, n, delivery, Eff::Panic);
            // On wasm32 a panic aborts the instance: no unwinding, no release.
            if edge {
                crash(delivery, Some(PANIC_BEFORE));
                return Box::pin(std::future::pending());
            }
            panic!("{PANIC_BEFORE}");
        }
        _ => {}
    }
    Box::pin(async move {
        if edge && step == Step::PanicInside {
            result(&world, n, delivery, Eff::Panic);
            crash(delivery, Some(PANIC_INSIDE));
            std::future::pending::<()>().await;
        }
        let res = run_step(world.clone(), ctx, n, delivery, step, breaker, timeout).await;
        if edge && frozen() {
            // Finished after its instance crashed: it never happened.
            return std::future::pending().await;
        }
        if res.is_ok() {
            let mut st = world.lock();
            st.ledger.entry(key.clone()).or_default().push((n, fence));
            world.log(
                &mut st,
                Some(n),
                Ev::Effect {
                    delivery,
                    key,
                    fence,
                },
            );
        }
        res
    })
}
