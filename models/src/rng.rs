//! Deterministic randomness whose algorithm lives in our own code.
//!
//! Every peer must derive the same initial weights, data split, partition and
//! shuffle from the same seed, on every platform and every version of our
//! dependencies. So we do not use `rand`'s generators (their streams may change
//! between releases) but SplitMix64 (Steele, Lea, Flood 2014) and FNV-1a, both
//! a few lines long and fully specified here.

/// SplitMix64: tiny, fast, and passes BigCrush; plenty for init and shuffling.
#[derive(Debug, Clone)]
pub struct DetRng {
    state: u64,
}

impl DetRng {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// A generator for a named purpose, so that independent streams (init of
    /// each tensor, each epoch's shuffle) do not depend on consumption order.
    pub fn derive(seed: u64, purpose: &str) -> Self {
        Self::new(seed ^ stable_hash64(purpose.as_bytes()).rotate_left(17))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1), with 24 bits of precision (exact in f32).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.next_f32()
    }

    /// Uniform integer in [0, n) without modulo bias (Lemire's method).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        loop {
            let m = (self.next_u64() as u128) * (n as u128);
            let low = m as u64;
            if low >= n.wrapping_neg() % n {
                return (m >> 64) as u64;
            }
        }
    }

    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

/// FNV-1a, 64-bit: a stable hash for names and peer ids (never for security).
pub fn stable_hash64(bytes: &[u8]) -> u64 {
    StableHasher::new().update(bytes).finish()
}

/// [`stable_hash64`] in parts: `StableHasher::new().update(a).update(b).finish()`
/// equals `stable_hash64` of `a` followed by `b`. A hasher fed a common
/// prefix once can be copied and finished with each suffix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StableHasher(u64);

impl Default for StableHasher {
    fn default() -> Self {
        Self::new()
    }
}

impl StableHasher {
    pub const fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    #[must_use]
    pub fn update(mut self, bytes: &[u8]) -> Self {
        for &b in bytes {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
        self
    }

    /// FNV's state through one SplitMix finaliser round, so that nearby
    /// inputs spread over all bits.
    pub fn finish(self) -> u64 {
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hasher_in_parts_gives_the_hash_of_the_whole() {
        // Pinned: placements (and so shard ownership) hang on these values.
        assert_eq!(stable_hash64(b""), StableHasher::new().finish());
        let whole = stable_hash64(b"peer-7\x03\x00\x00\x00");
        assert_eq!(whole, 12_083_070_938_269_055_430);
        let prefix = StableHasher::new().update(b"peer-7");
        assert_eq!(prefix.update(&3u32.to_le_bytes()).finish(), whole);
        assert_ne!(prefix.update(&4u32.to_le_bytes()).finish(), whole);
    }

    #[test]
    fn splitmix_matches_reference_vector() {
        // Reference values for seed 1234567 from the SplitMix64 reference code.
        let mut r = DetRng::new(1234567);
        assert_eq!(r.next_u64(), 6457827717110365317);
        assert_eq!(r.next_u64(), 3203168211198807973);
    }

    #[test]
    fn shuffle_is_a_permutation_and_seeded() {
        let mut a: Vec<u32> = (0..1000).collect();
        let mut b = a.clone();
        DetRng::new(7).shuffle(&mut a);
        DetRng::new(7).shuffle(&mut b);
        assert_eq!(a, b);
        assert_ne!(a, (0..1000).collect::<Vec<_>>());
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
    }

    #[test]
    fn below_stays_in_range() {
        let mut r = DetRng::new(3);
        for n in [1u64, 2, 3, 10, 1 << 40] {
            for _ in 0..1000 {
                assert!(r.below(n) < n);
            }
        }
    }

    #[test]
    fn uniform_in_range() {
        let mut r = DetRng::new(9);
        for _ in 0..10_000 {
            let x = r.uniform(-0.5, 0.5);
            assert!((-0.5..0.5).contains(&x));
        }
    }
}
