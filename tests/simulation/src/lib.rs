//! A deterministic simulation of the whole system (work in progress).
