//! The ring: the schedule as pure data ([`schedule`]) and the engine that drives a transport
//! through it ([`engine`]).

pub(crate) mod call;
pub mod device_engine;
mod device_work;
pub mod doubling;
pub mod engine;
mod exec;
pub(crate) mod failure;
pub mod lanes;
pub mod links;
pub(crate) mod one_way;
mod op_wait;
pub mod schedule;

pub use schedule::{chunk, plan, plan_p2p, split, Buf, Collective, Count, Loc, Op, Plan, PlanArgs};
