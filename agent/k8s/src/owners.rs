//! Which Service owns each EndpointSlice the slice watch has shown, by name only: what an
//! opt-in needs to get that Service's slices one by one, without a list of the collection.
//!
//! About 300 bytes per slice and its Service (the names, both ways), whatever the slice
//! holds. Looked up both ways, so an opt-in finds its Service's slices without a scan of the
//! cluster's. Kept across a relist with a generation mark, so a relist costs no second copy:
//! entries the relist did not show again are dropped when it ends.

use std::collections::HashMap;

use skewless_model::{ServiceKey, SliceKey};

#[derive(Debug, Default)]
pub(crate) struct Owners {
    /// Slice -> its Service's name (the same namespace) and the list generation that last
    /// showed it.
    by_slice: HashMap<SliceKey, (Box<str>, u32)>,
    /// Service -> the names of its slices: `by_slice` the other way round. A Service with no
    /// slice left has no entry.
    by_owner: HashMap<ServiceKey, Vec<Box<str>>>,
    generation: u32,
}

impl Owners {
    /// Records a slice's owner as its latest change shows it (none: the label is gone).
    pub(crate) fn set(&mut self, slice: SliceKey, owner: Option<&ServiceKey>) {
        let Some(owner) = owner else {
            self.remove(&slice);
            return;
        };
        let entry = (owner.name.as_str().into(), self.generation);
        match self.by_slice.insert(slice.clone(), entry) {
            Some((previous, _)) if *previous == *owner.name => {}
            previous => {
                if let Some((previous, _)) = previous {
                    self.unlink(&slice, &previous);
                }
                self.by_owner
                    .entry(owner.clone())
                    .or_default()
                    .push(slice.name.as_str().into());
            }
        }
    }

    pub(crate) fn remove(&mut self, slice: &SliceKey) {
        if let Some((owner, _)) = self.by_slice.remove(slice) {
            self.unlink(slice, &owner);
        }
    }

    /// Takes `slice` out of `owner`'s names, and `owner` out when it has none left.
    fn unlink(&mut self, slice: &SliceKey, owner: &str) {
        let key = ServiceKey::new(slice.namespace.as_str(), owner);
        if let Some(names) = self.by_owner.get_mut(&key) {
            names.retain(|n| **n != *slice.name);
            if names.is_empty() {
                self.by_owner.remove(&key);
            }
        }
    }

    /// A relist begins: what it does not show again is dropped at [`Owners::end_relist`].
    pub(crate) fn begin_relist(&mut self) {
        self.generation = self.generation.wrapping_add(1);
    }

    pub(crate) fn end_relist(&mut self) {
        let current = self.generation;
        let stale: Vec<SliceKey> = self
            .by_slice
            .iter()
            .filter(|(_, (_, g))| *g != current)
            .map(|(slice, _)| slice.clone())
            .collect();
        for slice in stale {
            self.remove(&slice);
        }
    }

    /// The names of `service`'s slices.
    pub(crate) fn slices_of(&self, service: &ServiceKey) -> Vec<String> {
        let mut names: Vec<String> = self
            .by_owner
            .get(service)
            .map(|names| names.iter().map(|n| n.to_string()).collect())
            .unwrap_or_default();
        names.sort_unstable();
        names
    }

    pub(crate) fn len(&self) -> usize {
        self.by_slice.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(ns: &str, name: &str) -> SliceKey {
        SliceKey {
            namespace: ns.into(),
            name: name.into(),
        }
    }

    fn svc(ns: &str, name: &str) -> ServiceKey {
        ServiceKey::new(ns.to_owned(), name.to_owned())
    }

    #[test]
    fn a_services_slices_are_found_by_owner_and_namespace() {
        let mut o = Owners::default();
        o.set(slice("a", "web-1"), Some(&svc("a", "web")));
        o.set(slice("a", "web-2"), Some(&svc("a", "web")));
        o.set(slice("b", "web-1"), Some(&svc("b", "web")));
        o.set(slice("a", "db-1"), Some(&svc("a", "db")));
        assert_eq!(o.slices_of(&svc("a", "web")), ["web-1", "web-2"]);
        assert_eq!(o.slices_of(&svc("b", "web")), ["web-1"]);
        assert!(o.slices_of(&svc("c", "web")).is_empty());
    }

    #[test]
    fn a_relabelled_or_deleted_slice_leaves_its_owner() {
        let mut o = Owners::default();
        o.set(slice("a", "s"), Some(&svc("a", "web")));
        o.set(slice("a", "s"), Some(&svc("a", "db")));
        assert!(o.slices_of(&svc("a", "web")).is_empty());
        assert_eq!(o.slices_of(&svc("a", "db")), ["s"]);
        o.set(slice("a", "s"), None);
        assert!(o.slices_of(&svc("a", "db")).is_empty());
        o.set(slice("a", "t"), Some(&svc("a", "db")));
        o.remove(&slice("a", "t"));
        assert_eq!(o.len(), 0);
        assert!(o.by_owner.is_empty(), "no Service is kept without a slice");
    }

    #[test]
    fn a_slice_shown_again_is_listed_once() {
        let mut o = Owners::default();
        o.set(slice("a", "s"), Some(&svc("a", "web")));
        o.set(slice("a", "s"), Some(&svc("a", "web")));
        o.begin_relist();
        o.set(slice("a", "s"), Some(&svc("a", "web")));
        o.end_relist();
        assert_eq!(o.slices_of(&svc("a", "web")), ["s"]);
    }

    #[test]
    fn a_relist_drops_what_it_did_not_show_again() {
        let mut o = Owners::default();
        o.set(slice("a", "kept"), Some(&svc("a", "web")));
        o.set(slice("a", "gone"), Some(&svc("a", "web")));
        o.begin_relist();
        // Until the relist ends, what it has not shown yet is still known.
        assert_eq!(o.slices_of(&svc("a", "web")), ["gone", "kept"]);
        o.set(slice("a", "kept"), Some(&svc("a", "web")));
        o.set(slice("a", "moved"), Some(&svc("a", "db")));
        o.end_relist();
        assert_eq!(o.slices_of(&svc("a", "web")), ["kept"]);
        assert_eq!(o.slices_of(&svc("a", "db")), ["moved"]);
        o.begin_relist();
        o.end_relist();
        assert_eq!(o.len(), 0);
        assert!(
            o.by_owner.is_empty(),
            "a relist that shows nothing forgets every Service"
        );
    }
}
