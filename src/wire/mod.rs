//! The PMI-1 wire codec: request lines in, response lines out. Pure functions over bytes; the engine in
//! [`crate::server`] decides what to answer.

pub mod request;
pub mod response;
pub mod spawn;

pub use request::{parse, ParseError, Request};
pub use spawn::{Pairs, SpawnBuilder, SpawnCommand, SpawnRequest};
