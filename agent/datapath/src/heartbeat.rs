//! The agent's heartbeat, which the connect hooks require fresh before they redirect.

use skewless_common::HEARTBEAT_MAP;

use crate::{Datapath, Error};

impl Datapath {
    /// Records that the agent is alive now. Once a heartbeat has been written, the hooks only
    /// redirect while it stays fresh (younger than `HEARTBEAT_STALE_NS`), so the caller must
    /// keep beating (the agent does every 200 ms) from the part of the program whose hang
    /// should stop redirects.
    ///
    /// # Errors
    /// When the clock or the map cannot be read or written.
    pub fn beat(&mut self) -> Result<(), Error> {
        // CLOCK_MONOTONIC is what the hooks' bpf_ktime_get_ns reads.
        let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
            .map_err(|e| Error::Clock(std::io::Error::from(e)))?;
        let ns = u64::try_from(now.tv_sec()).unwrap_or(0) * 1_000_000_000
            + u64::try_from(now.tv_nsec()).unwrap_or(0);
        self.heartbeat.set(0, ns, 0).map_err(|source| Error::Map {
            name: HEARTBEAT_MAP,
            source,
        })
    }
}
