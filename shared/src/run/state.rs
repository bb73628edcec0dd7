//! Shared state for handlers: values given once to the registry and read
//! from each execution's context by type ([`Registry::state`](crate::Registry::state),
//! [`JobContext::state`](crate::JobContext::state)), as axum's `State` and
//! apalis's `Data<T>` are.

use std::any::{type_name, Any, TypeId};
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use crate::model::maybe_send::{MaybeSend, MaybeSync};

/// A value of any type a handler may share.
trait StateValue: Any + MaybeSend + MaybeSync {
    fn as_any(&self) -> &dyn Any;
}

impl<T: Any + MaybeSend + MaybeSync> StateValue for T {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The values a registry shares with its handlers, one per type. Cloned
/// into every delivery's context as one reference count.
#[derive(Clone, Default)]
pub(crate) struct StateMap(Arc<HashMap<TypeId, Arc<dyn StateValue>>>);

impl fmt::Debug for StateMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StateMap")
            .field("values", &self.0.len())
            .finish()
    }
}

impl StateMap {
    /// Adds `value`, replacing an earlier value of its type.
    pub(crate) fn insert<T: Any + MaybeSend + MaybeSync>(&mut self, value: T) {
        Arc::make_mut(&mut self.0).insert(TypeId::of::<T>(), Arc::new(value));
    }

    /// The value of type `T`, if one was given.
    pub(crate) fn get<T: Any>(&self) -> Result<&T, MissingState> {
        self.0
            .get(&TypeId::of::<T>())
            // `**value`: the stored value's own `as_any`, not the `Arc`'s.
            .and_then(|value| (**value).as_any().downcast_ref::<T>())
            .ok_or(MissingState {
                type_name: type_name::<T>(),
            })
    }
}

/// A handler asked for state of a type the registry was not given
/// ([`JobContext::state`](crate::JobContext::state)). A handler that
/// returns it with `?` fails the execution as an ordinary error, which is
/// retried by the job's policy: give the registry the value at start
/// ([`Registry::state`](crate::Registry::state)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no state of type `{type_name}` was given to the registry (Registry::state)")]
pub struct MissingState {
    type_name: &'static str,
}

impl MissingState {
    /// The name of the type asked for.
    pub fn type_name(&self) -> &'static str {
        self.type_name
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn one_value_per_type_found_by_its_type() {
        let mut state = StateMap::default();
        assert_eq!(
            state.get::<u32>().unwrap_err().to_string(),
            "no state of type `u32` was given to the registry (Registry::state)"
        );
        state.insert(7u32);
        state.insert(String::from("db"));
        state.insert(Arc::new(5u64));
        assert_eq!(state.get::<u32>(), Ok(&7));
        assert_eq!(state.get::<String>().map(String::as_str), Ok("db"));
        assert_eq!(state.get::<Arc<u64>>().map(|v| **v), Ok(5));
        assert!(state.get::<u64>().is_err(), "an Arc<u64> is not a u64");
        state.insert(8u32);
        assert_eq!(
            state.get::<u32>(),
            Ok(&8),
            "a second value replaces the first"
        );
    }

    #[test]
    fn clones_share_what_was_given_before_and_not_after() {
        let mut state = StateMap::default();
        state.insert(1u8);
        let earlier = state.clone();
        state.insert(2u16);
        assert_eq!(earlier.get::<u8>(), Ok(&1));
        assert!(earlier.get::<u16>().is_err());
        assert_eq!(state.get::<u16>(), Ok(&2));
    }
}
