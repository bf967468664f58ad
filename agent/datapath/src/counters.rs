//! The programs' per-CPU counters, summed: one value per [`Counter`], so a new counter is a
//! line in `skewless-common` and nothing here.

use std::ops::Index;

pub use skewless_common::Counter;
use skewless_common::{COUNTERS_LEN, COUNTERS_MAP};

use crate::{Datapath, Error};

/// Kernel-side counters, summed over CPUs; index it with a [`Counter`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Counters([u64; COUNTERS_LEN as usize]);

impl Counters {
    /// Every counter with its value, in index order.
    pub fn iter(&self) -> impl Iterator<Item = (Counter, u64)> + '_ {
        Counter::ALL.into_iter().zip(self.0)
    }
}

impl Default for Counters {
    fn default() -> Self {
        Self([0; COUNTERS_LEN as usize])
    }
}

impl Index<Counter> for Counters {
    type Output = u64;

    fn index(&self, counter: Counter) -> &u64 {
        &self.0[counter.index() as usize]
    }
}

impl std::fmt::Debug for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.iter().map(|(c, v)| (c.name(), v)))
            .finish()
    }
}

impl Datapath {
    /// Reads the kernel counters, summed over CPUs.
    ///
    /// # Errors
    /// When the counter map cannot be read.
    pub fn counters(&self) -> Result<Counters, Error> {
        let mut counters = Counters::default();
        for counter in Counter::ALL {
            let per_cpu = self
                .counters
                .get(&counter.index(), 0)
                .map_err(|source| Error::Map {
                    name: COUNTERS_MAP,
                    source,
                })?;
            counters.0[counter.index() as usize] = per_cpu.iter().sum();
        }
        Ok(counters)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_indexed_and_shown_by_name() {
        let mut c = Counters::default();
        c.0[Counter::StaleHeartbeat.index() as usize] = 3;
        assert_eq!(c[Counter::StaleHeartbeat], 3);
        assert_eq!(c[Counter::Connect4Seen], 0);
        assert_eq!(c.iter().count(), Counter::ALL.len());
        assert!(
            format!("{c:?}").contains("\"StaleHeartbeat\": 3"),
            "Debug names each counter: {c:?}"
        );
    }
}
