//! Where a run resumes after every node stopped: pure, from the checkpoint
//! offers of the roster's members (each node gossips what its checkpoint
//! folder holds; every member of an agreed roster has every other member's
//! heartbeat, so all compute the same point).
//!
//! The rule: each shard resumes from the newest version any member holds.
//! Under BSP, where all shards advance together, the newest version that
//! *every* shard has somewhere is preferred, so the model resumes at one
//! round; only when no such version exists does each shard take its own
//! newest. Workers resume at the step of the oldest chosen checkpoint,
//! which continues their data position. No offer at all: a fresh start. A
//! shard that some members hold and none offers at all: an error, since
//! resuming without it would silently lose it.

use std::collections::BTreeMap;

use shoal_protocol::CheckpointOffer;

/// Where to resume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResumePoint {
    /// The step every worker resumes at.
    pub step: u64,
    /// The version each shard resumes from.
    pub versions: Vec<u64>,
}

/// Why no resume point exists.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResumeError {
    #[error(
        "cannot resume: no member holds a checkpoint of shard(s) {missing:?} (of {shards}); restore those \
         checkpoint files, or start a new run (another run_id, or empty checkpoint folders)"
    )]
    Missing { missing: Vec<u32>, shards: u32 },
}

/// The resume point from every member's offers (this node's included).
pub fn resume_point(offers: &[CheckpointOffer], shards: u32, bsp: bool) -> Result<Option<ResumePoint>, ResumeError> {
    if offers.iter().all(|o| o.shard_ids().is_empty()) {
        return Ok(None);
    }
    // Per shard: version -> the step recorded with it (the smallest offered).
    let mut held: BTreeMap<u32, BTreeMap<u64, u64>> = BTreeMap::new();
    for o in offers {
        for s in o.shard_ids().into_iter().filter(|&s| s < shards) {
            let step = held.entry(s).or_default().entry(o.version).or_insert(o.step);
            *step = (*step).min(o.step);
        }
    }
    let missing: Vec<u32> = (0..shards).filter(|s| !held.contains_key(s)).collect();
    if !missing.is_empty() {
        return Err(ResumeError::Missing { missing, shards });
    }
    if bsp {
        // The newest version held for every shard.
        let first = held.values().next().map(|versions| versions.keys().rev().copied().collect::<Vec<_>>());
        let common =
            first.unwrap_or_default().into_iter().find(|v| held.values().all(|versions| versions.contains_key(v)));
        if let Some(v) = common {
            let step = held.values().filter_map(|versions| versions.get(&v)).copied().min().unwrap_or(v);
            return Ok(Some(ResumePoint { step, versions: vec![v; shards as usize] }));
        }
    }
    let newest: Vec<(u64, u64)> =
        (0..shards).filter_map(|s| held.get(&s)?.iter().next_back().map(|(&v, &st)| (v, st))).collect();
    Ok(Some(ResumePoint {
        step: newest.iter().map(|n| n.1).min().unwrap_or(0),
        versions: newest.iter().map(|n| n.0).collect(),
    }))
}

/// The offers that describe a checkpoint folder's contents: one per
/// version held, newest first, at most `max`. `held` lists (shard, version,
/// step) for every readable checkpoint.
pub fn offers_of(held: &[(u32, u64, u64)], max: usize) -> Vec<CheckpointOffer> {
    let mut by_version: BTreeMap<u64, (u64, Vec<u32>)> = BTreeMap::new();
    for &(shard, version, step) in held {
        let e = by_version.entry(version).or_insert((step, Vec::new()));
        e.0 = e.0.min(step);
        e.1.push(shard);
    }
    by_version.into_iter().rev().take(max).map(|(v, (step, shards))| CheckpointOffer::new(v, step, shards)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer(v: u64, shards: &[u32]) -> CheckpointOffer {
        CheckpointOffer::new(v, v, shards.iter().copied())
    }

    #[test]
    fn no_offers_is_a_fresh_start() {
        assert_eq!(resume_point(&[], 4, true), Ok(None));
        // No shard at all: nothing to resume, and no panic.
        assert_eq!(resume_point(&[offer(50, &[0])], 0, true), Ok(Some(ResumePoint { step: 0, versions: vec![] })));
        assert_eq!(resume_point(&[CheckpointOffer::default()], 4, true), Ok(None));
    }

    #[test]
    fn bsp_resumes_at_the_newest_round_every_shard_has() {
        // Node A wrote 0 and 1 at 150 and 175; node B wrote 2 and 3 at 150
        // only (it died before its 175 writes): the round is 150.
        let offers = [offer(175, &[0, 1]), offer(150, &[0, 1]), offer(150, &[2, 3])];
        let p = resume_point(&offers, 4, true).ok().flatten();
        assert_eq!(p, Some(ResumePoint { step: 150, versions: vec![150; 4] }));
        // The other policies take each shard's newest.
        let p = resume_point(&offers, 4, false).ok().flatten();
        assert_eq!(p, Some(ResumePoint { step: 150, versions: vec![175, 175, 150, 150] }));
    }

    #[test]
    fn bsp_without_a_common_round_takes_each_shards_newest() {
        let offers = [offer(175, &[0]), offer(150, &[1])];
        let p = resume_point(&offers, 2, true).ok().flatten();
        assert_eq!(p, Some(ResumePoint { step: 150, versions: vec![175, 150] }));
    }

    #[test]
    fn a_shard_nobody_holds_is_an_error_naming_it() {
        let e = resume_point(&[offer(50, &[0, 2])], 4, true);
        assert_eq!(e, Err(ResumeError::Missing { missing: vec![1, 3], shards: 4 }));
        let text = e.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("[1, 3]") && text.contains("run_id"), "{text}");
    }

    #[test]
    fn the_recorded_step_is_where_workers_resume() {
        // Asynchronous policies: versions run ahead of the slowest worker.
        let offers = [CheckpointOffer::new(400, 96, [0]), CheckpointOffer::new(380, 95, [1])];
        let p = resume_point(&offers, 2, false).ok().flatten();
        assert_eq!(p, Some(ResumePoint { step: 95, versions: vec![400, 380] }));
    }

    #[test]
    fn offers_group_a_folder_by_version_newest_first() {
        let held = [(0, 50, 50), (1, 50, 50), (0, 25, 25), (1, 25, 24), (2, 75, 75)];
        let offers = offers_of(&held, 2);
        assert_eq!(offers.len(), 2);
        assert_eq!((offers[0].version, offers[0].shard_ids()), (75, vec![2]));
        assert_eq!((offers[1].version, offers[1].shard_ids()), (50, vec![0, 1]));
        let all = offers_of(&held, 8);
        assert_eq!((all[2].version, all[2].step), (25, 24));
    }
}
