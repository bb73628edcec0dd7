pub(crate) mod budget;
pub(crate) mod replay;
pub(crate) mod settle;
