//! The KV engine: a hash index over a RAM tier (slab classes in the shared
//! arena, SIEVE eviction per class, pages moving between classes by age)
//! and an optional NVMe tier (disk.rs).
//!
//! Memory goes where it is needed. A class that needs a slot and has none
//! free either evicts its own SIEVE victim or takes a whole page from
//! another class, whichever holds older data: every slot carries the time
//! it was last stored or read, every page the newest of its slots, and the
//! page another class has used least recently is compared with the victim.
//! So a store of any mix of sizes keeps the most recently used blocks of
//! every size. (It used to cap a class at a "fair share" of pages, and a
//! class at its share evicted its own new blocks while other classes kept
//! old ones.)
//!
//! All bookkeeping sits behind one lock whose critical sections never wait
//! for I/O: lookups, slot allocation and eviction. Bulk bytes move outside it
//! (TCP sends, client copies over shared memory, checksums of committed puts),
//! protected by reservations and per-slot read references. Demotion to the
//! NVMe tier copies into the tier's write buffer under the lock.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tarn_io::AlignedBuf;

use crate::arena::{Arena, Geometry, HugePages};
use crate::disk::{self, DiskLoc, DiskTier, RecordKind, RecordSource};
use crate::proto::{crc32c, Digest, GetEntry, Status};
use crate::KvError;

/// Smallest slab class; smaller values still take a slot of this size.
pub const SLOT_MIN_BYTES: usize = 4096;
/// Each slab class is this much larger than the previous (then rounded up to
/// 4 KiB): at most ~25% of a slot is unused.
const CLASS_GROWTH: f64 = 1.25;
/// Smallest slab page. Pages move between classes as the value mix changes.
const PAGE_MIN_BYTES: usize = 4 << 20;
/// Slot ids pack the page into 16 bits and the slot within it into 16 bits.
const PAGES_MAX: usize = u16::MAX as usize;
const NO_SLOT: u32 = u32::MAX;
/// Distinct namespaces a server tracks (each has its counters).
pub const NAMESPACES_MAX: usize = 65_536;
/// Longest lease a PIN may ask for; a client that dies cannot hold blocks longer.
pub const PIN_LEASE_MAX_MS: u64 = 10 * 60 * 1000;
/// Lease of a PIN that names none.
pub const PIN_LEASE_DEFAULT_MS: u64 = 30 * 1000;
/// Tries (1 ms apart) a shutdown spill waits for the flusher, per block.
const SPILL_RETRIES: usize = 5_000;

const _: () = assert!(PAGE_MIN_BYTES / SLOT_MIN_BYTES <= 1 << 16);

/// Engine settings.
#[derive(Debug, Clone)]
pub struct KvConfig {
    /// RAM tier budget.
    pub memory_bytes: u64,
    /// Largest value accepted.
    pub value_max_bytes: u64,
    /// NVMe tier directory (None: RAM only).
    pub disk_dir: Option<PathBuf>,
    /// NVMe tier budget.
    pub disk_bytes: u64,
    /// Segment file size (rounded up to fit two write buffers).
    pub segment_bytes: u64,
    /// Whether the RAM tier's arena is on huge pages.
    pub huge_pages: HugePages,
    /// A value put in parts that still misses some this long after its
    /// first, with none being written, is dropped (a writer died).
    pub part_timeout: Duration,
}

impl Default for KvConfig {
    fn default() -> Self {
        KvConfig {
            memory_bytes: 1 << 30,
            value_max_bytes: 4 << 20,
            disk_dir: None,
            disk_bytes: 64 << 30,
            segment_bytes: 256 << 20,
            huge_pages: HugePages::Auto,
            part_timeout: PART_TIMEOUT_DEFAULT,
        }
    }
}

/// A block's identity inside the engine: interned namespace plus digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    pub namespace: u32,
    pub digest: Digest,
}

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        let mut b = [0u8; 36];
        b[..4].copy_from_slice(&self.namespace.to_le_bytes());
        b[4..].copy_from_slice(&self.digest);
        state.write(&b);
    }
}

/// xxh3 with a per-process random seed: digests come from clients, so the
/// index must not be floodable with chosen collisions.
#[derive(Clone)]
struct KeyHasher {
    seed: u64,
}

struct KeyHasherState {
    seed: u64,
    hash: u64,
}

impl BuildHasher for KeyHasher {
    type Hasher = KeyHasherState;
    fn build_hasher(&self) -> KeyHasherState {
        KeyHasherState {
            seed: self.seed,
            hash: 0,
        }
    }
}

impl Hasher for KeyHasherState {
    fn write(&mut self, bytes: &[u8]) {
        self.hash ^= xxhash_rust::xxh3::xxh3_64_with_seed(bytes, self.seed);
    }
    fn finish(&self) -> u64 {
        self.hash
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    len: u64,
    crc: u32,
    ram: u32,
    disk: Option<DiskLoc>,
    pins: u32,
    pin_until_ms: u64,
}

impl Entry {
    fn pinned(&self, now_ms: u64) -> bool {
        self.pins > 0 && now_ms < self.pin_until_ms
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    Reserved {
        conn: u64,
        seq: u32,
        len: u64,
    },
    Live,
    /// Deleted while a TCP send was reading it; freed by the last reader.
    Dying,
}

#[derive(Debug, Clone, Copy)]
struct SlotMeta {
    key: Key,
    state: SlotState,
    visited: bool,
    readers: u16,
    /// Reads since it was stored, saturating: [`HOT_READS`] make it hot.
    reads: u8,
    /// When the block was last stored or read (the engine's clock).
    stamp: u64,
    /// Toward the head (newer).
    prev: u32,
    /// Toward the tail (older).
    next: u32,
}

const EMPTY_SLOT: SlotMeta = SlotMeta {
    key: Key {
        namespace: 0,
        digest: [0; 32],
    },
    state: SlotState::Free,
    visited: false,
    readers: 0,
    reads: 0,
    stamp: 0,
    prev: NO_SLOT,
    next: NO_SLOT,
};

struct Page {
    class: Option<usize>,
    slots: Vec<SlotMeta>,
    /// Slots taken from the class's free list and not given back.
    used: u32,
    /// Slots that cannot be evicted whatever their age: reserved, dying,
    /// or being read. A page with any cannot move to another class.
    busy: u32,
    /// The newest stamp of its slots since it was last empty.
    newest: u64,
}

impl Page {
    /// How old the page's data is, for moving it to another class: an empty
    /// page costs nothing to move, so it is the oldest of all. None: it
    /// cannot move now.
    fn age_key(&self) -> Option<u64> {
        match (self.busy, self.used) {
            (0, 0) => Some(0),
            (0, _) => Some(self.newest),
            _ => None,
        }
    }
}

fn slot_busy(m: &SlotMeta) -> bool {
    matches!(m.state, SlotState::Reserved { .. } | SlotState::Dying) || m.readers > 0
}

/// A slab class with its SIEVE queue of live slots (head newest).
struct Class {
    size: usize,
    free: Vec<u32>,
    /// Its pages, in no order.
    page_ids: Vec<usize>,
    /// The page of this class that could move with the oldest data, and its
    /// age key: exact when Some, recomputed when None.
    oldest: Option<(usize, u64)>,
    head: u32,
    tail: u32,
    hand: u32,
    live: usize,
    live_bytes: u64,
    stats: ClassStats,
}

/// Counters of one slab class: where its memory went and why blocks left.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ClassStats {
    /// Pages this class took from the unused pool or from other classes.
    pub pages_in: u64,
    /// Pages other classes took from this one.
    pub pages_out: u64,
    /// Blocks evicted to make room in this class (its SIEVE victim).
    pub evicted_room: u64,
    /// Blocks evicted because their page moved to another class.
    pub evicted_page_moved: u64,
}

/// One slab class as `stats` and `/metrics` show it.
#[derive(Debug, Clone)]
pub struct ClassReport {
    pub slot_bytes: u64,
    pub pages: u64,
    pub blocks: u64,
    pub bytes: u64,
    pub counters: ClassStats,
}

impl ClassReport {
    /// Its figures by the names `stats` (`class.SIZE.NAME`) and `/metrics`
    /// (`counter="NAME"`) give them.
    pub fn named(&self) -> [(&'static str, u64); 7] {
        [
            ("pages", self.pages),
            ("blocks", self.blocks),
            ("bytes", self.bytes),
            ("pages_in", self.counters.pages_in),
            ("pages_out", self.counters.pages_out),
            ("evicted_room", self.counters.evicted_room),
            ("evicted_page_moved", self.counters.evicted_page_moved),
        ]
    }
}

/// Counters per namespace: hit rates that can be explained.
#[derive(Debug, Default, Clone)]
pub struct NamespaceStats {
    pub gets: u64,
    pub hits_ram: u64,
    pub hits_disk: u64,
    pub misses_not_found: u64,
    pub misses_corrupt: u64,
    pub misses_no_space: u64,
    pub exists_keys: u64,
    pub exists_hits: u64,
    pub puts_stored: u64,
    pub puts_existing: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub blocks: u64,
    /// Keys of batches refused because the client routed them by an older
    /// view of the cluster's KV members (it re-routes and asks again).
    pub misses_not_owner: u64,
    /// Gets asked of this node as the next-ranked one after the first
    /// missed, and how many it had.
    pub fallback_gets: u64,
    pub fallback_hits: u64,
    /// Blocks stored as copies: fallback hits written back to their owner
    /// and second copies of hot blocks.
    pub copies_stored: u64,
    /// Blocks that became hot (read [`HOT_READS`] times).
    pub hot_marked: u64,
}

impl NamespaceStats {
    /// Every counter by name, as STATS and `/metrics` report them.
    pub fn named(&self) -> [(&'static str, u64); 18] {
        [
            ("gets", self.gets),
            ("hits_ram", self.hits_ram),
            ("hits_disk", self.hits_disk),
            ("misses_not_found", self.misses_not_found),
            ("misses_corrupt", self.misses_corrupt),
            ("misses_no_space", self.misses_no_space),
            ("misses_not_owner", self.misses_not_owner),
            ("exists_keys", self.exists_keys),
            ("exists_hits", self.exists_hits),
            ("puts_stored", self.puts_stored),
            ("puts_existing", self.puts_existing),
            ("bytes_read", self.bytes_read),
            ("bytes_written", self.bytes_written),
            ("blocks", self.blocks),
            ("fallback_gets", self.fallback_gets),
            ("fallback_hits", self.fallback_hits),
            ("copies_stored", self.copies_stored),
            ("hot_marked", self.hot_marked),
        ]
    }
}

/// Routing outcomes of one batch ([`Engine::count_routing`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct RoutingCounts {
    pub not_owner: u64,
    pub fallback_gets: u64,
    pub fallback_hits: u64,
    pub copies_stored: u64,
}

/// Reads of a block since it was stored that make it hot: its get results
/// say so ([`tarn_wire::proto::RESULT_HOT`]) and routing clients keep a
/// second copy on the next-ranked node.
pub const HOT_READS: u8 = 8;

#[derive(Debug, Default, Clone)]
struct GlobalStats {
    evicted_demoted: u64,
    evicted_dropped: u64,
    promoted: u64,
    demote_dropped: u64,
    disk_segments_dropped: u64,
    disk_blocks_dropped: u64,
    pinned_relocated: u64,
    corrupt_ram: u64,
    corrupt_disk: u64,
    reservations_aborted: u64,
    checksum_mismatches: u64,
    pages_stolen: u64,
    parts_abandoned: u64,
}

struct State {
    index: HashMap<Key, Entry, KeyHasher>,
    ns_ids: HashMap<Box<[u8]>, u32>,
    ns_names: Vec<Box<[u8]>>,
    ns_stats: Vec<NamespaceStats>,
    classes: Vec<Class>,
    pages: Vec<Page>,
    free_pages: Vec<usize>,
    disk: Option<DiskTier>,
    stats: GlobalStats,
    reservation_seq: u32,
    /// Advances on every store and read of a RAM block: the stamps' clock.
    clock: u64,
    /// Values being put in parts, by slot, and the slot of each key.
    assemblies: HashMap<u32, Assembly>,
    assembling: HashMap<Key, u32>,
    /// When abandoned assemblies are looked for next (engine clock, ms).
    parts_sweep_ms: u64,
}

/// A value put in byte ranges by several writers (tensor-parallel ranks
/// each holding some of a block's heads): its slot is reserved by no
/// connection, and it becomes visible once every byte was written and no
/// writer is still copying.
struct Assembly {
    key: Key,
    seq: u32,
    len: u64,
    /// Written ranges, sorted and merged.
    filled: Vec<(u64, u64)>,
    /// Parts being copied in now.
    writers: u32,
    started_ms: u64,
    complete: bool,
}

impl Assembly {
    fn fill(&mut self, start: u64, end: u64) {
        self.filled.push((start, end));
        self.filled.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(self.filled.len());
        for &(a, b) in &self.filled {
            match merged.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        self.filled = merged;
    }

    fn covered(&self) -> bool {
        self.filled == [(0, self.len)]
    }
}

/// Marks a part's token (a reservation of an assembly, not of a connection).
pub const PART_TOKEN: u64 = 1 << 63;
/// The connection id an assembly's slot is reserved by: none.
const ASSEMBLY_CONN: u64 = u64::MAX;
/// [`KvConfig::part_timeout`] unless told otherwise: longer than a frame's
/// timeout, so no part is still being read from a socket when it ends.
pub const PART_TIMEOUT_DEFAULT: Duration = Duration::from_secs(60);

/// What storing one part did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartCommit {
    /// `Ok`: the part is in, the value still misses some; or a failure.
    Status(Status),
    /// The last part is in: checksum the value at `value_offset` and call
    /// [`Engine::finish_value`].
    Complete { value_offset: u64, len: u64 },
}

/// Where a GET's bytes come from, decided under the lock.
pub enum ReadPlan {
    /// In the RAM tier. With a read reference held (TCP) the slot cannot be
    /// reused until [`Engine::release`]; without (shared memory) the client
    /// checks the generation after copying.
    Ram(RamRef),
    /// On the NVMe tier: read, verify, then promote.
    Disk(DiskRead),
    Miss(Status),
}

#[derive(Debug, Clone, Copy)]
pub struct RamRef {
    /// Read [`HOT_READS`] times or more since stored.
    pub hot: bool,
    pub slot: u32,
    /// Index into the arena's generation table.
    pub generation_index: u32,
    pub generation: u32,
    /// Arena offset of the value's first byte.
    pub value_offset: u64,
    pub value_len: u64,
    pub crc: u32,
}

pub struct DiskRead {
    key: Key,
    loc: DiskLoc,
    source: RecordSource,
    namespace_len: usize,
    pub value_len: u64,
    pub crc: u32,
}

/// A verified value read from the NVMe tier, with the key it belongs to (so
/// it can only ever be promoted under that key).
pub struct DiskBytes {
    key: Key,
    crc: u32,
    buf: Arc<AlignedBuf>,
    start: usize,
    len: usize,
}

impl DiskBytes {
    pub fn value(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }
}

/// The engine.
pub struct Engine {
    arena: Arena,
    state: Mutex<State>,
    config: KvConfig,
    epoch: Instant,
}

fn slot_id(page: usize, index: usize) -> u32 {
    ((page as u32) << 16) | index as u32
}

fn slot_parts(slot: u32) -> (usize, usize) {
    ((slot >> 16) as usize, (slot & 0xffff) as usize)
}

fn class_sizes(value_max_bytes: usize) -> Vec<usize> {
    let top = value_max_bytes.max(SLOT_MIN_BYTES).next_multiple_of(4096);
    let mut sizes = vec![SLOT_MIN_BYTES];
    while *sizes.last().expect("non-empty") < top {
        let last = *sizes.last().expect("non-empty");
        let next = ((last as f64 * CLASS_GROWTH) as usize)
            .next_multiple_of(4096)
            .max(last + 4096)
            .min(top);
        sizes.push(next);
    }
    // KV blocks are often exactly a power of two: give those a class of their
    // own instead of a slot up to 25% larger.
    let mut p = SLOT_MIN_BYTES;
    while p < top {
        sizes.push(p);
        p *= 2;
    }
    sizes.sort_unstable();
    sizes.dedup();
    sizes
}

impl Engine {
    /// Creates the arena, opens (and rescans) the NVMe tier.
    pub fn open(config: KvConfig) -> Result<Arc<Engine>, KvError> {
        if config.value_max_bytes == 0 || config.value_max_bytes > 1 << 30 {
            return Err(KvError::Config(
                "the largest KV value must be between 1 byte and 1 GiB".into(),
            ));
        }
        let sizes = class_sizes(config.value_max_bytes as usize);
        let page_size = PAGE_MIN_BYTES.max(sizes.last().expect("classes").next_power_of_two());
        let page_count = (config.memory_bytes / page_size as u64) as usize;
        if page_count < 2 {
            return Err(KvError::Config(format!(
                "--kv-memory must hold at least two slab pages of {page_size} bytes"
            )));
        }
        let page_count = page_count.min(PAGES_MAX);
        let geometry = Geometry::new(page_size, page_count, SLOT_MIN_BYTES);
        let arena = Arena::create(geometry, config.huge_pages)
            .map_err(|e| KvError::Io("creating the arena", e))?;
        let pages = arena.pages_report(config.huge_pages);
        tracing::info!(bytes = arena.len(), "KV arena on {pages}");
        let mut seed = [0u8; 8];
        getrandom::fill(&mut seed).map_err(|e| KvError::Config(e.to_string()))?;
        let expected_blocks = (config.memory_bytes / (64 << 10)) as usize;
        let state = State {
            index: HashMap::with_capacity_and_hasher(
                expected_blocks.max(1024),
                KeyHasher {
                    seed: u64::from_le_bytes(seed),
                },
            ),
            ns_ids: HashMap::new(),
            ns_names: Vec::new(),
            ns_stats: Vec::new(),
            classes: sizes
                .iter()
                .map(|s| Class {
                    size: *s,
                    free: Vec::new(),
                    page_ids: Vec::new(),
                    oldest: None,
                    head: NO_SLOT,
                    tail: NO_SLOT,
                    hand: NO_SLOT,
                    live: 0,
                    live_bytes: 0,
                    stats: ClassStats::default(),
                })
                .collect(),
            pages: (0..page_count)
                .map(|_| Page {
                    class: None,
                    slots: Vec::new(),
                    used: 0,
                    busy: 0,
                    newest: 0,
                })
                .collect(),
            free_pages: (0..page_count).rev().collect(),
            disk: None,
            stats: GlobalStats::default(),
            reservation_seq: 0,
            clock: 0,
            assemblies: HashMap::new(),
            assembling: HashMap::new(),
            parts_sweep_ms: 0,
        };
        let engine = Arc::new(Engine {
            arena,
            state: Mutex::new(state),
            config: config.clone(),
            epoch: Instant::now(),
        });
        if let Some(dir) = &config.disk_dir {
            let weak = Arc::downgrade(&engine);
            let (tier, report) = DiskTier::open(
                dir,
                config.disk_bytes,
                config.segment_bytes,
                config.value_max_bytes,
                move |f| {
                    if let Some(e) = weak.upgrade() {
                        e.flushed(f);
                    }
                },
            )
            .map_err(|e| KvError::Io("opening the KV disk tier", e))?;
            let mut st = engine.lock();
            let mut blocks = 0u64;
            for rec in report.records {
                let Ok(ns) = st.intern(&rec.header.namespace) else {
                    continue;
                };
                let key = Key {
                    namespace: ns,
                    digest: rec.header.digest,
                };
                match rec.header.kind {
                    RecordKind::Block => {
                        let fresh = st.index.insert(
                            key,
                            Entry {
                                len: rec.header.value_len,
                                crc: rec.header.value_crc,
                                ram: NO_SLOT,
                                disk: Some(rec.loc),
                                pins: 0,
                                pin_until_ms: 0,
                            },
                        );
                        if fresh.is_none() {
                            st.ns_stats[ns as usize].blocks += 1;
                        }
                    }
                    RecordKind::Tombstone => {
                        if st.index.remove(&key).is_some() {
                            st.ns_stats[ns as usize].blocks -= 1;
                        }
                    }
                }
            }
            // Segments learn which keys point into them only now (the newest
            // record of a key wins).
            let mut tier = tier;
            for (key, e) in st.index.iter() {
                if let Some(seg) = e.disk.and_then(|loc| tier.segment_mut(loc.segment)) {
                    seg.keys.push(*key);
                    blocks += 1;
                }
            }
            tracing::info!(
                dir = %dir.display(),
                segments = report.segments,
                blocks,
                skipped_4k_blocks = report.blocks_skipped,
                discarded_segments = report.segments_discarded,
                direct_io = tier.direct_io,
                "KV disk tier rebuilt"
            );
            st.disk = Some(tier);
        }
        Ok(engine)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic under the lock leaves counters possibly off, never bytes
        // wrong (every read is checksummed): keep serving.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// True when it holds no block (a fresh start, or an NVMe tier that
    /// held nothing).
    pub fn is_empty(&self) -> bool {
        self.lock().index.is_empty()
    }

    pub fn config(&self) -> &KvConfig {
        &self.config
    }

    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    /// Interns a namespace (creating its counters on first use).
    pub fn namespace(&self, name: &[u8]) -> Result<u32, Status> {
        let mut st = self.lock();
        if let Some(id) = st.ns_ids.get(name) {
            return Ok(*id);
        }
        st.intern(name).map_err(|_| Status::NoSpace)
    }

    /// Namespaces known, with their counters.
    pub fn namespace_stats(&self) -> Vec<(Vec<u8>, NamespaceStats)> {
        let st = self.lock();
        st.ns_names
            .iter()
            .zip(&st.ns_stats)
            .map(|(n, s)| (n.to_vec(), s.clone()))
            .collect()
    }

    pub fn exists(&self, namespace: u32, digests: &[Digest], out: &mut Vec<bool>) {
        let mut st = self.lock();
        out.clear();
        let mut hits = 0;
        for d in digests {
            let hit = st.index.contains_key(&Key {
                namespace,
                digest: *d,
            });
            hits += hit as u64;
            out.push(hit);
        }
        let s = &mut st.ns_stats[namespace as usize];
        s.exists_keys += digests.len() as u64;
        s.exists_hits += hits;
    }

    /// Decides where each GET entry's bytes come from. `hold` takes a read
    /// reference on RAM slots (release with [`Engine::release`]).
    pub fn plan_reads(
        &self,
        namespace: u32,
        entries: &[GetEntry],
        hold: bool,
        out: &mut Vec<ReadPlan>,
    ) {
        out.clear();
        let mut st = self.lock();
        let st = &mut *st;
        for g in entries {
            let key = Key {
                namespace,
                digest: g.digest,
            };
            st.ns_stats[namespace as usize].gets += 1;
            let Some(e) = st.index.get(&key).copied() else {
                st.ns_stats[namespace as usize].misses_not_found += 1;
                out.push(ReadPlan::Miss(Status::NotFound));
                continue;
            };
            if g.range(e.len).is_none() {
                out.push(ReadPlan::Miss(Status::BadRange));
                continue;
            }
            if e.ram != NO_SLOT {
                st.ns_stats[namespace as usize].hits_ram += 1;
                out.push(ReadPlan::Ram(st.ram_ref(&self.arena, e.ram, &e, hold)));
                continue;
            }
            let loc = e.disk.expect("an entry is in RAM or on disk");
            let ns_len = st.ns_names[namespace as usize].len();
            let record_len = disk::record_len(ns_len, e.len) as usize;
            match st.disk.as_mut().and_then(|d| d.source(loc, record_len)) {
                Some(source) => out.push(ReadPlan::Disk(DiskRead {
                    key,
                    loc,
                    source,
                    namespace_len: ns_len,
                    value_len: e.len,
                    crc: e.crc,
                })),
                None => {
                    st.forget(key);
                    st.ns_stats[namespace as usize].misses_not_found += 1;
                    out.push(ReadPlan::Miss(Status::NotFound));
                }
            }
        }
    }

    /// Reads a block from the NVMe tier and verifies header and checksum. A
    /// bad record is dropped from the index and reported as `Corrupt`.
    pub async fn read_disk(&self, read: &DiskRead) -> Result<DiskBytes, Status> {
        let rlen = disk::record_len(read.namespace_len, read.value_len) as usize;
        let (buf, start) = match &read.source {
            RecordSource::Memory(buf, off) => (buf.clone(), *off),
            RecordSource::File(file, offset) => {
                let (res, buf) = file
                    .read_exact_at(AlignedBuf::with_capacity(rlen), rlen, *offset)
                    .await;
                match res {
                    Ok(()) => (Arc::new(buf), 0),
                    Err(error) => {
                        tracing::warn!(%error, "KV disk read failed");
                        self.drop_bad_record(read, false);
                        return Err(Status::NotFound);
                    }
                }
            }
        };
        let good = buf.len() >= start + rlen
            && disk::decode_record_header(&buf[start..], self.config.value_max_bytes).is_some_and(
                |h| {
                    h.kind == RecordKind::Block
                        && h.digest == read.key.digest
                        && h.value_len == read.value_len
                        && h.value_crc == read.crc
                        && self.lock().ns_names[read.key.namespace as usize][..] == h.namespace[..]
                },
            );
        let vstart = start + disk::record_header_len(read.namespace_len);
        let bytes = DiskBytes {
            key: read.key,
            crc: read.crc,
            buf,
            start: vstart,
            len: read.value_len as usize,
        };
        if !good || crc32c(bytes.value()) != read.crc {
            self.drop_bad_record(read, true);
            return Err(Status::Corrupt);
        }
        let mut st = self.lock();
        let s = &mut st.ns_stats[read.key.namespace as usize];
        s.hits_disk += 1;
        Ok(bytes)
    }

    fn drop_bad_record(&self, read: &DiskRead, corrupt: bool) {
        let mut st = self.lock();
        let ns = read.key.namespace as usize;
        if corrupt {
            st.stats.corrupt_disk += 1;
            st.ns_stats[ns].misses_corrupt += 1;
            tracing::warn!(
                segment = read.loc.segment,
                offset = read.loc.offset,
                "KV record failed verification; dropped"
            );
        } else {
            st.ns_stats[ns].misses_not_found += 1;
        }
        let current = st.index.get(&read.key).copied();
        if let Some(mut e) = current {
            if e.disk == Some(read.loc) {
                e.disk = None;
                if e.ram == NO_SLOT {
                    st.forget(read.key);
                } else {
                    st.index.insert(read.key, e);
                }
            }
        }
    }

    /// Puts a verified NVMe-tier value back in RAM. Returns the RAM reference
    /// (with a read reference when `hold`), or None when RAM has no room.
    pub fn promote(&self, bytes: &DiskBytes, hold: bool) -> Option<RamRef> {
        let key = bytes.key;
        let mut st = self.lock();
        let st = &mut *st;
        let e = st.index.get(&key).copied()?;
        if e.ram != NO_SLOT {
            return Some(st.ram_ref(&self.arena, e.ram, &e, hold));
        }
        if e.len != bytes.len as u64 || e.crc != bytes.crc {
            return None;
        }
        let class = st.class_for(e.len)?;
        let slot = st.alloc(&self.arena, class, self.now_ms())?;
        // Allocation may have evicted and rolled segments; the entry may be gone.
        let Some(mut e) = st.index.get(&key).copied() else {
            st.free_slot(&self.arena, slot);
            return None;
        };
        let off = st.slot_offset(&self.arena, slot);
        // SAFETY: a freshly allocated slot, exclusively ours under the lock.
        unsafe { self.arena.slice_mut(off, bytes.len) }.copy_from_slice(bytes.value());
        e.ram = slot;
        st.index.insert(key, e);
        st.make_live(slot, key, e.len);
        st.stats.promoted += 1;
        Some(st.ram_ref(&self.arena, slot, &e, hold))
    }

    /// Drops read references taken by `plan_reads`/`promote` with `hold`.
    pub fn release(&self, slots: &[u32]) {
        if slots.is_empty() {
            return;
        }
        let mut st = self.lock();
        for s in slots {
            st.release_read(&self.arena, *s);
        }
    }

    /// Verifies the whole value's checksum in RAM (before serving a range,
    /// whose bytes alone cannot be checked against it). A mismatch drops the
    /// block and returns false.
    pub fn verify_ram(&self, namespace: u32, digest: &Digest, r: &RamRef) -> bool {
        // SAFETY: the caller holds a read reference or accepts reuse (checked by
        // generation); the range lies inside the arena.
        let bytes = unsafe { self.arena.slice(r.value_offset, r.value_len as usize) };
        if crc32c(bytes) == r.crc {
            return true;
        }
        let mut st = self.lock();
        st.stats.corrupt_ram += 1;
        st.ns_stats[namespace as usize].misses_corrupt += 1;
        let key = Key {
            namespace,
            digest: *digest,
        };
        if st.index.get(&key).is_some_and(|e| e.ram == r.slot) {
            st.remove_entry(&self.arena, key);
        }
        tracing::warn!("KV block in RAM failed its checksum; dropped");
        false
    }

    /// Reserves a slot for a value of `len` bytes. AlreadyExists when the key
    /// is stored (an idempotent put), TooLarge, or NoSpace.
    pub fn reserve(
        &self,
        conn: u64,
        namespace: u32,
        digest: &Digest,
        len: u64,
    ) -> Result<(u64, u64), Status> {
        if len > self.config.value_max_bytes {
            return Err(Status::TooLarge);
        }
        let key = Key {
            namespace,
            digest: *digest,
        };
        let now = self.now_ms();
        let mut st = self.lock();
        let st = &mut *st;
        if st.index.contains_key(&key) {
            st.ns_stats[namespace as usize].puts_existing += 1;
            return Err(Status::AlreadyExists);
        }
        st.sweep_parts(&self.arena, now, self.config.part_timeout);
        let class = st.class_for(len).ok_or(Status::TooLarge)?;
        let slot = st.alloc(&self.arena, class, now).ok_or(Status::NoSpace)?;
        st.reservation_seq = st.reservation_seq.wrapping_add(1);
        let seq = st.reservation_seq;
        st.with_slot(slot, |m| {
            m.key = key;
            m.state = SlotState::Reserved { conn, seq, len };
        });
        let token = ((slot as u64) << 32) | seq as u64;
        Ok((token, st.slot_offset(&self.arena, slot)))
    }

    /// Makes a reservation's bytes visible (`checksum_ok`), or frees it.
    pub fn commit(&self, conn: u64, token: u64, crc: u32, checksum_ok: bool) -> Status {
        let mut st = self.lock();
        let st = &mut *st;
        let (slot, seq) = ((token >> 32) as u32, token as u32);
        let Some(len) = st.reserved(slot, conn, seq) else {
            // Only the daemon names reservations now, its own and live ones;
            // if one were gone, nothing was stored.
            debug_assert!(
                false,
                "commit of a reservation this connection does not hold"
            );
            return Status::NoSpace;
        };
        let key = st.meta_mut(slot).key;
        if !checksum_ok {
            st.stats.checksum_mismatches += 1;
            st.free_slot(&self.arena, slot);
            return Status::ChecksumMismatch;
        }
        let ns = key.namespace as usize;
        if st.index.contains_key(&key) {
            // Another writer committed the same block first.
            st.free_slot(&self.arena, slot);
            st.ns_stats[ns].puts_existing += 1;
            return Status::AlreadyExists;
        }
        st.index.insert(
            key,
            Entry {
                len,
                crc,
                ram: slot,
                disk: None,
                pins: 0,
                pin_until_ms: 0,
            },
        );
        st.make_live(slot, key, len);
        st.ns_stats[ns].puts_stored += 1;
        st.ns_stats[ns].bytes_written += len;
        st.ns_stats[ns].blocks += 1;
        Status::Ok
    }

    /// Reserves room for a part, bytes `[offset, offset + len)` of a value
    /// of `value_len` bytes that several writers put: the first part of a
    /// key reserves the whole value's slot. Returns the part's token and
    /// the arena offset its bytes go to.
    pub fn reserve_part(
        &self,
        namespace: u32,
        digest: &Digest,
        value_len: u64,
        offset: u64,
        len: u64,
    ) -> Result<(u64, u64), Status> {
        if value_len > self.config.value_max_bytes {
            return Err(Status::TooLarge);
        }
        if len == 0 || offset.checked_add(len).is_none_or(|end| end > value_len) {
            return Err(Status::BadRange);
        }
        let key = Key {
            namespace,
            digest: *digest,
        };
        let now = self.now_ms();
        let mut st = self.lock();
        let st = &mut *st;
        if st.index.contains_key(&key) {
            st.ns_stats[namespace as usize].puts_existing += 1;
            return Err(Status::AlreadyExists);
        }
        if let Some(&slot) = st.assembling.get(&key) {
            let a = st.assemblies.get_mut(&slot).expect("assembly of a key");
            if a.complete {
                return Err(Status::AlreadyExists);
            }
            if a.len != value_len {
                return Err(Status::BadRange);
            }
            a.writers += 1;
            let token = PART_TOKEN | ((slot as u64) << 32) | a.seq as u64;
            return Ok((token, st.slot_offset(&self.arena, slot) + offset));
        }
        st.sweep_parts(&self.arena, now, self.config.part_timeout);
        let class = st.class_for(value_len).ok_or(Status::TooLarge)?;
        let slot = st.alloc(&self.arena, class, now).ok_or(Status::NoSpace)?;
        debug_assert!(slot < 1 << 31, "slot numbers leave the part bit free");
        st.reservation_seq = st.reservation_seq.wrapping_add(1);
        let seq = st.reservation_seq;
        st.with_slot(slot, |m| {
            m.key = key;
            m.state = SlotState::Reserved {
                conn: ASSEMBLY_CONN,
                seq,
                len: value_len,
            };
        });
        st.assemblies.insert(
            slot,
            Assembly {
                key,
                seq,
                len: value_len,
                filled: Vec::new(),
                writers: 1,
                started_ms: now,
                complete: false,
            },
        );
        st.assembling.insert(key, slot);
        let token = PART_TOKEN | ((slot as u64) << 32) | seq as u64;
        Ok((token, st.slot_offset(&self.arena, slot) + offset))
    }

    /// Records a part copied in (`checksum_ok`: its bytes matched the
    /// writer's CRC). The part that completes the value, with no other
    /// still being written, answers `Complete`.
    pub fn commit_part(&self, token: u64, offset: u64, len: u64, checksum_ok: bool) -> PartCommit {
        let mut st = self.lock();
        let st = &mut *st;
        let Some(a) = st.assembly(token) else {
            return PartCommit::Status(Status::NoSpace);
        };
        a.writers -= 1;
        if !checksum_ok {
            st.stats.checksum_mismatches += 1;
            return PartCommit::Status(Status::ChecksumMismatch);
        }
        a.fill(offset, offset + len);
        if a.covered() && a.writers == 0 && !a.complete {
            a.complete = true;
            let len = a.len;
            let slot = ((token & !PART_TOKEN) >> 32) as u32;
            return PartCommit::Complete {
                value_offset: st.slot_offset(&self.arena, slot),
                len,
            };
        }
        PartCommit::Status(Status::Ok)
    }

    /// Makes a complete value visible with its checksum (computed by the
    /// caller over the whole slot).
    pub fn finish_value(&self, token: u64, crc: u32) -> Status {
        let mut st = self.lock();
        let st = &mut *st;
        let slot = ((token & !PART_TOKEN) >> 32) as u32;
        let Some(a) = st.assemblies.remove(&slot) else {
            return Status::NoSpace;
        };
        st.assembling.remove(&a.key);
        let ns = a.key.namespace as usize;
        if st.index.contains_key(&a.key) {
            st.free_slot(&self.arena, slot);
            st.ns_stats[ns].puts_existing += 1;
            return Status::AlreadyExists;
        }
        st.index.insert(
            a.key,
            Entry {
                len: a.len,
                crc,
                ram: slot,
                disk: None,
                pins: 0,
                pin_until_ms: 0,
            },
        );
        st.make_live(slot, a.key, a.len);
        st.ns_stats[ns].puts_stored += 1;
        st.ns_stats[ns].bytes_written += a.len;
        st.ns_stats[ns].blocks += 1;
        Status::Ok
    }

    /// A part whose copy failed (its connection went away): the value
    /// waits for it again, or is dropped after [`KvConfig::part_timeout`].
    pub fn abort_part(&self, token: u64) {
        let mut st = self.lock();
        if let Some(a) = st.assembly(token) {
            a.writers -= 1;
        }
    }

    /// Gives back a reservation without storing (a connection that went away).
    pub fn abort(&self, conn: u64, token: u64) {
        let mut st = self.lock();
        let (slot, seq) = ((token >> 32) as u32, token as u32);
        if st.reserved(slot, conn, seq).is_some() {
            st.stats.reservations_aborted += 1;
            st.free_slot(&self.arena, slot);
        }
    }

    /// Marks blocks as recently used.
    pub fn touch(&self, namespace: u32, digests: &[Digest], out: &mut Vec<Status>) {
        let mut st = self.lock();
        out.clear();
        for d in digests {
            let key = Key {
                namespace,
                digest: *d,
            };
            match st.index.get(&key).copied() {
                Some(e) => {
                    if e.ram != NO_SLOT {
                        st.meta_mut(e.ram).visited = true;
                        st.stamp(e.ram);
                    }
                    out.push(Status::Ok);
                }
                None => out.push(Status::NotFound),
            }
        }
    }

    /// Takes a lease on blocks so eviction leaves them alone while an engine
    /// loads them. `held` collects the keys pinned, for release on disconnect.
    pub fn pin(
        &self,
        namespace: u32,
        digests: &[Digest],
        lease_ms: u64,
        out: &mut Vec<Status>,
        held: &mut Vec<Key>,
    ) {
        let lease = if lease_ms == 0 {
            PIN_LEASE_DEFAULT_MS
        } else {
            lease_ms.min(PIN_LEASE_MAX_MS)
        };
        let until = self.now_ms() + lease;
        let mut st = self.lock();
        out.clear();
        for d in digests {
            let key = Key {
                namespace,
                digest: *d,
            };
            match st.index.get_mut(&key) {
                Some(e) => {
                    e.pins = e.pins.saturating_add(1);
                    e.pin_until_ms = e.pin_until_ms.max(until);
                    held.push(key);
                    out.push(Status::Ok);
                }
                None => out.push(Status::NotFound),
            }
        }
    }

    pub fn unpin(
        &self,
        namespace: u32,
        digests: &[Digest],
        out: &mut Vec<Status>,
        held: &mut Vec<Key>,
    ) {
        let mut st = self.lock();
        out.clear();
        for d in digests {
            let key = Key {
                namespace,
                digest: *d,
            };
            let Some(i) = held.iter().position(|k| *k == key) else {
                out.push(Status::NotFound);
                continue;
            };
            held.swap_remove(i);
            st.unpin_one(key);
            out.push(Status::Ok);
        }
    }

    pub fn delete(&self, namespace: u32, digests: &[Digest], out: &mut Vec<Status>) {
        let mut st = self.lock();
        out.clear();
        for d in digests {
            let key = Key {
                namespace,
                digest: *d,
            };
            if st.remove_entry(&self.arena, key) {
                out.push(Status::Ok);
            } else {
                out.push(Status::NotFound);
            }
        }
    }

    /// Frees what a closed connection held: reservations never committed and
    /// pins never released.
    pub fn release_connection(&self, conn: u64, tokens: &[u64], pins: &[Key]) {
        for t in tokens {
            if t & PART_TOKEN != 0 {
                self.abort_part(*t);
            } else {
                self.abort(conn, *t);
            }
        }
        let mut st = self.lock();
        for k in pins {
            st.unpin_one(*k);
        }
    }

    /// At a clean shutdown, with an NVMe tier: writes every block held only
    /// in RAM to it, oldest first, so that a restart finds the whole store
    /// (the tier keeps its newest records when they do not all fit). Waits
    /// for the flusher rather than dropping blocks; gives up on a block the
    /// tier cannot take (a write error) after [`SPILL_RETRIES`]. Returns the
    /// blocks and bytes written.
    pub fn spill_to_disk(&self) -> (u64, u64) {
        let mut st = self.lock();
        if st.disk.is_none() {
            return (0, 0);
        }
        let mut order: Vec<(u64, Key)> = st
            .index
            .iter()
            .filter(|(_, e)| e.ram != NO_SLOT && e.disk.is_none())
            .map(|(k, e)| (st.meta(e.ram).stamp, *k))
            .collect();
        order.sort_unstable_by_key(|(stamp, _)| *stamp);
        let dropped_before = st.stats.demote_dropped;
        let (mut blocks, mut bytes) = (0u64, 0u64);
        'blocks: for (_, key) in order {
            for _ in 0..SPILL_RETRIES {
                // Looked up again each try: the lock was let go in between.
                let Some(mut e) = st
                    .index
                    .get(&key)
                    .copied()
                    .filter(|e| e.ram != NO_SLOT && e.disk.is_none())
                else {
                    continue 'blocks;
                };
                let offset = st.slot_offset(&self.arena, e.ram);
                // SAFETY: a live slot holds e.len committed bytes; under the
                // lock nobody frees it while we copy.
                let value = unsafe { self.arena.slice(offset, e.len as usize) };
                if let Some(loc) = st.disk_append(RecordKind::Block, key, value, e.crc) {
                    e.disk = Some(loc);
                    st.index.insert(key, e);
                    blocks += 1;
                    bytes += e.len;
                    continue 'blocks;
                }
                // The flusher is behind: let it hand its buffers back.
                drop(st);
                std::thread::sleep(Duration::from_millis(1));
                st = self.lock();
            }
            tracing::warn!("the KV NVMe tier takes no more blocks; the rest stay in RAM only");
            break;
        }
        // Waiting is not dropping: only what was given up counts as dropped.
        st.stats.demote_dropped = dropped_before;
        // The open buffer too, and every write finished: the tier's own
        // shutdown then has nothing left that could need a spare buffer.
        for _ in 0..SPILL_RETRIES {
            let done = st
                .disk
                .as_mut()
                .is_none_or(|d| d.seal_buffer().is_ok() && !d.writes_pending());
            if done {
                break;
            }
            drop(st);
            std::thread::sleep(Duration::from_millis(1));
            st = self.lock();
        }
        (blocks, bytes)
    }

    fn flushed(&self, f: disk::Flushed) {
        if let Err(error) = &f.result {
            // The records in that buffer read back as garbage and are caught by
            // their checksums; nothing wrong is ever served.
            tracing::warn!(segment = f.segment, %error, "KV segment write failed");
        }
        let mut st = self.lock();
        if let Some(d) = st.disk.as_mut() {
            d.flushed(&f);
        }
    }

    /// Counters and gauges, global and (if given) for one namespace.
    pub fn stats(&self, namespace: Option<u32>) -> Vec<(String, u64)> {
        let st = self.lock();
        let g = &st.stats;
        let ram_blocks = st.classes.iter().map(|c| c.live as u64).sum::<u64>();
        let mut v: Vec<(String, u64)> = vec![
            ("blocks".into(), st.index.len() as u64),
            ("ram_blocks".into(), ram_blocks),
            (
                "ram_used_bytes".into(),
                st.classes.iter().map(|c| c.live_bytes).sum::<u64>(),
            ),
            (
                "ram_capacity_bytes".into(),
                (self.arena.geometry.page_count * self.arena.geometry.page_size_bytes) as u64,
            ),
            ("ram_huge_pages".into(), self.arena.huge_pages as u64),
            ("evicted_demoted".into(), g.evicted_demoted),
            ("evicted_dropped".into(), g.evicted_dropped),
            ("promoted".into(), g.promoted),
            ("demote_dropped".into(), g.demote_dropped),
            ("disk_segments_dropped".into(), g.disk_segments_dropped),
            ("disk_blocks_dropped".into(), g.disk_blocks_dropped),
            ("pinned_relocated".into(), g.pinned_relocated),
            ("corrupt_ram".into(), g.corrupt_ram),
            ("corrupt_disk".into(), g.corrupt_disk),
            ("reservations_aborted".into(), g.reservations_aborted),
            ("checksum_mismatches".into(), g.checksum_mismatches),
            ("parts_abandoned".into(), g.parts_abandoned),
            ("pages_stolen".into(), g.pages_stolen),
            ("value_max_bytes".into(), self.config.value_max_bytes),
        ];
        for c in st.class_reports() {
            for (what, val) in c.named() {
                v.push((format!("class.{}.{what}", c.slot_bytes), val));
            }
        }
        if let Some(d) = &st.disk {
            v.push(("disk_used_bytes".into(), d.used_bytes()));
            v.push(("disk_capacity_bytes".into(), d.capacity_bytes()));
            v.push(("disk_segments".into(), d.segments.len() as u64));
            v.push(("disk_direct_io".into(), d.direct_io as u64));
        }
        if let Some(ns) = namespace {
            for (name, val) in st.ns_stats[ns as usize].named() {
                v.push((format!("namespace.{name}"), val));
            }
        }
        v
    }

    /// The slab classes that ever held a page: occupancy, page moves and
    /// evictions by reason.
    pub fn class_reports(&self) -> Vec<ClassReport> {
        self.lock().class_reports()
    }

    /// Counts bytes served and misses for lack of room (server bookkeeping).
    pub fn count_read(&self, namespace: u32, bytes: u64, no_space_misses: u64) {
        let mut st = self.lock();
        let s = &mut st.ns_stats[namespace as usize];
        s.bytes_read += bytes;
        s.misses_no_space += no_space_misses;
    }

    /// Counts the cluster's routing outcomes (server bookkeeping): keys
    /// refused as routed by a stale view, fallback gets and their hits,
    /// copies stored.
    pub fn count_routing(&self, namespace: u32, c: RoutingCounts) {
        let mut st = self.lock();
        let s = &mut st.ns_stats[namespace as usize];
        s.misses_not_owner += c.not_owner;
        s.fallback_gets += c.fallback_gets;
        s.fallback_hits += c.fallback_hits;
        s.copies_stored += c.copies_stored;
    }
}

impl State {
    /// The assembly a part token names, if it is still there.
    fn assembly(&mut self, token: u64) -> Option<&mut Assembly> {
        let slot = ((token & !PART_TOKEN) >> 32) as u32;
        let seq = token as u32;
        self.assemblies.get_mut(&slot).filter(|a| a.seq == seq)
    }

    /// Frees the slots of values whose writers went away before the last
    /// part (`timeout` after the first, none being written). Run before
    /// every slot is taken, for puts of whole values too (so abandoned
    /// slots go back even when no value in parts follows), at most twice
    /// per timeout and once a second.
    fn sweep_parts(&mut self, arena: &Arena, now_ms: u64, timeout: Duration) {
        let limit = timeout.as_millis() as u64;
        if self.assemblies.is_empty() || now_ms < self.parts_sweep_ms {
            return;
        }
        self.parts_sweep_ms = now_ms + (limit / 2).clamp(1, 1000);
        let stale: Vec<u32> = self
            .assemblies
            .iter()
            .filter(|(_, a)| a.writers == 0 && !a.complete && now_ms - a.started_ms > limit)
            .map(|(slot, _)| *slot)
            .collect();
        for slot in stale {
            let a = self.assemblies.remove(&slot).expect("listed");
            self.assembling.remove(&a.key);
            self.stats.parts_abandoned += 1;
            self.free_slot(arena, slot);
        }
    }

    fn class_reports(&self) -> Vec<ClassReport> {
        self.classes
            .iter()
            .filter(|c| c.stats.pages_in > 0)
            .map(|c| ClassReport {
                slot_bytes: c.size as u64,
                pages: c.page_ids.len() as u64,
                blocks: c.live as u64,
                bytes: c.live_bytes,
                counters: c.stats,
            })
            .collect()
    }

    fn intern(&mut self, name: &[u8]) -> Result<u32, ()> {
        if let Some(id) = self.ns_ids.get(name) {
            return Ok(*id);
        }
        if self.ns_names.len() >= NAMESPACES_MAX {
            return Err(());
        }
        let id = self.ns_names.len() as u32;
        self.ns_ids.insert(name.into(), id);
        self.ns_names.push(name.into());
        self.ns_stats.push(NamespaceStats::default());
        Ok(id)
    }

    fn class_for(&self, len: u64) -> Option<usize> {
        self.classes
            .iter()
            .position(|c| c.size as u64 >= len.max(1))
    }

    fn meta_mut(&mut self, slot: u32) -> &mut SlotMeta {
        let (p, i) = slot_parts(slot);
        &mut self.pages[p].slots[i]
    }

    fn meta(&self, slot: u32) -> &SlotMeta {
        let (p, i) = slot_parts(slot);
        &self.pages[p].slots[i]
    }

    fn slot_class(&self, slot: u32) -> usize {
        self.pages[slot_parts(slot).0]
            .class
            .expect("slot of an assigned page")
    }

    fn slot_offset(&self, arena: &Arena, slot: u32) -> u64 {
        let (p, i) = slot_parts(slot);
        let g = &arena.geometry;
        let size = self.classes[self.slot_class(slot)].size;
        (g.data_offset + p * g.page_size_bytes + i * size) as u64
    }

    fn generation_index(arena: &Arena, slot: u32) -> usize {
        let (p, i) = slot_parts(slot);
        p * arena.geometry.slots_per_page_max + i
    }

    fn ram_ref(&mut self, arena: &Arena, slot: u32, e: &Entry, hold: bool) -> RamRef {
        let gi = State::generation_index(arena, slot);
        let mut reads = 0;
        self.with_slot(slot, |m| {
            m.visited = true;
            m.reads = m.reads.saturating_add(1);
            reads = m.reads;
            if hold {
                m.readers += 1;
            }
        });
        self.stamp(slot);
        if reads == HOT_READS {
            let ns = self.meta(slot).key.namespace as usize;
            self.ns_stats[ns].hot_marked += 1;
        }
        RamRef {
            hot: reads >= HOT_READS,
            slot,
            generation_index: gi as u32,
            generation: arena
                .generation(gi)
                .map(|g| g.load(std::sync::atomic::Ordering::Acquire))
                .unwrap_or(0),
            value_offset: self.slot_offset(arena, slot),
            value_len: e.len,
            crc: e.crc,
        }
    }

    fn reserved(&mut self, slot: u32, conn: u64, seq: u32) -> Option<u64> {
        let (p, i) = slot_parts(slot);
        let meta = self.pages.get(p)?.slots.get(i)?;
        match meta.state {
            SlotState::Reserved {
                conn: c,
                seq: s,
                len,
            } if c == conn && s == seq => Some(len),
            _ => None,
        }
    }

    fn assign_page(&mut self, page: usize, class: usize, arena: &Arena) {
        let size = self.classes[class].size;
        let n = arena.geometry.page_size_bytes / size;
        let p = &mut self.pages[page];
        p.class = Some(class);
        p.slots.clear();
        p.slots.resize(n, EMPTY_SLOT);
        p.used = 0;
        p.busy = 0;
        p.newest = 0;
        let c = &mut self.classes[class];
        c.page_ids.push(page);
        c.stats.pages_in += 1;
        c.free.reserve(n);
        c.free.extend((0..n).rev().map(|i| slot_id(page, i)));
        self.page_changed(page);
    }

    /// Changes a slot's metadata, keeping its page's count of busy slots.
    fn with_slot(&mut self, slot: u32, f: impl FnOnce(&mut SlotMeta)) {
        let (p, i) = slot_parts(slot);
        let m = &mut self.pages[p].slots[i];
        let before = slot_busy(m);
        f(m);
        let after = slot_busy(m);
        if before != after {
            let page = &mut self.pages[p];
            if after {
                page.busy += 1;
            } else {
                page.busy -= 1;
            }
            self.page_changed(p);
        }
    }

    /// Marks a slot as stored or read now.
    fn stamp(&mut self, slot: u32) {
        self.clock += 1;
        let now = self.clock;
        let (p, i) = slot_parts(slot);
        self.pages[p].slots[i].stamp = now;
        self.pages[p].newest = now;
        self.page_changed(p);
    }

    /// Keeps its class's `oldest` exact after a page's age key changed:
    /// a page that became older than the cached one replaces it; the
    /// cached page growing newer or unable to move clears it.
    fn page_changed(&mut self, page: usize) {
        let Some(class) = self.pages[page].class else {
            return;
        };
        let key = self.pages[page].age_key();
        let c = &mut self.classes[class];
        match (c.oldest, key) {
            (Some((p, n)), Some(k)) if p == page => {
                c.oldest = (k <= n).then_some((page, k));
            }
            (Some((p, _)), None) if p == page => c.oldest = None,
            (Some((_, n)), Some(k)) if k < n => c.oldest = Some((page, k)),
            _ => {}
        }
    }

    /// The page of `class` that could move with the oldest data.
    fn class_oldest(&mut self, class: usize) -> Option<(usize, u64)> {
        if let Some(o) = self.classes[class].oldest {
            return Some(o);
        }
        let best = self.classes[class]
            .page_ids
            .iter()
            .filter_map(|p| self.pages[*p].age_key().map(|k| (*p, k)))
            .min_by_key(|(_, k)| *k);
        self.classes[class].oldest = best;
        best
    }

    /// The page of any class but `class` that could move with the oldest data.
    fn oldest_elsewhere(&mut self, class: usize) -> Option<(usize, u64)> {
        let mut best: Option<(usize, u64)> = None;
        for k in 0..self.classes.len() {
            if k == class || self.classes[k].page_ids.is_empty() {
                continue;
            }
            if let Some(o) = self.class_oldest(k) {
                if best.is_none_or(|b| o.1 < b.1) {
                    best = Some(o);
                }
            }
        }
        best
    }

    /// Takes a slot off its class's free list.
    fn take_free(&mut self, class: usize) -> Option<u32> {
        let s = self.classes[class].free.pop()?;
        let p = slot_parts(s).0;
        self.pages[p].used += 1;
        self.page_changed(p);
        Some(s)
    }

    /// A free slot of `class`: from the free list, an unused page, or by
    /// evicting the older of two: this class's SIEVE victim, or the page
    /// of another class used least recently (which then joins this class).
    fn alloc(&mut self, arena: &Arena, class: usize, now_ms: u64) -> Option<u32> {
        if let Some(s) = self.take_free(class) {
            return Some(s);
        }
        if let Some(p) = self.free_pages.pop() {
            self.assign_page(p, class, arena);
            return self.take_free(class);
        }
        // A page found holding a pinned block stays; a few tries, then the
        // class's own victim.
        let mut tries = 0;
        loop {
            let victim = self.sieve_victim(class, now_ms);
            let elsewhere = self
                .oldest_elsewhere(class)
                .filter(|(_, age)| victim.is_none_or(|v| *age < self.meta(v).stamp));
            match elsewhere {
                Some((page, _)) if tries < 8 => {
                    if self.move_page(arena, page, class, now_ms) {
                        return self.take_free(class);
                    }
                    tries += 1;
                    // A pinned block is in use: its page counts as used now.
                    self.clock += 1;
                    self.pages[page].newest = self.clock;
                    self.page_changed(page);
                }
                _ => {
                    let v = victim?;
                    self.evict(arena, v);
                    self.classes[class].stats.evicted_room += 1;
                    return Some(v);
                }
            }
        }
    }

    fn evictable(&self, slot: u32, now_ms: u64) -> bool {
        let m = self.meta(slot);
        m.state == SlotState::Live
            && m.readers == 0
            && !self.index.get(&m.key).is_some_and(|e| e.pinned(now_ms))
    }

    /// SIEVE: the hand walks from the tail toward the head, clearing visited
    /// bits, and stops at the first unvisited block nobody holds: the
    /// class's victim, left under the hand for `evict`.
    fn sieve_victim(&mut self, class: usize, now_ms: u64) -> Option<u32> {
        let c = &self.classes[class];
        let mut node = if c.hand != NO_SLOT { c.hand } else { c.tail };
        // Two passes clear every visited bit; anything left is held or pinned.
        for _ in 0..2 * c.live + 1 {
            if node == NO_SLOT {
                node = self.classes[class].tail;
                if node == NO_SLOT {
                    return None;
                }
            }
            let prev = self.meta(node).prev;
            if self.meta(node).visited {
                self.meta_mut(node).visited = false;
            } else if self.evictable(node, now_ms) {
                self.classes[class].hand = node;
                return Some(node);
            }
            node = prev;
        }
        self.classes[class].hand = node;
        None
    }

    /// Moves `page` from its class to `class`, evicting its blocks; false
    /// (nothing changed) when one of them is pinned.
    fn move_page(&mut self, arena: &Arena, page: usize, class: usize, now_ms: u64) -> bool {
        let victim = self.pages[page].class.expect("a page of a class");
        let movable = self.pages[page].busy == 0
            && self.pages[page]
                .slots
                .iter()
                .enumerate()
                .all(|(i, m)| match m.state {
                    SlotState::Free => true,
                    SlotState::Live => self.evictable(slot_id(page, i), now_ms),
                    _ => false,
                });
        if !movable {
            return false;
        }
        let mut evicted = 0;
        for i in 0..self.pages[page].slots.len() {
            if self.pages[page].slots[i].state == SlotState::Live {
                self.evict(arena, slot_id(page, i));
                evicted += 1;
            }
        }
        let vc = &mut self.classes[victim];
        vc.free.retain(|s| slot_parts(*s).0 != page);
        vc.page_ids.retain(|p| *p != page);
        if vc.oldest.is_some_and(|(p, _)| p == page) {
            vc.oldest = None;
        }
        vc.stats.pages_out += 1;
        vc.stats.evicted_page_moved += evicted;
        self.stats.pages_stolen += 1;
        self.assign_page(page, class, arena);
        true
    }

    /// Takes a live slot out of RAM: its block moves to the NVMe tier (unless
    /// already there) or is dropped. The slot is left Free but not listed:
    /// the caller reuses it.
    fn evict(&mut self, arena: &Arena, slot: u32) {
        let key = self.meta(slot).key;
        let class = self.slot_class(slot);
        self.list_remove(slot);
        let offset = self.slot_offset(arena, slot);
        if let Some(mut e) = self.index.get(&key).copied() {
            self.classes[class].live_bytes -= e.len;
            e.ram = NO_SLOT;
            if e.disk.is_none() {
                // SAFETY: a live slot holds e.len committed bytes; under the lock
                // nobody frees it while we copy.
                let bytes = unsafe { arena.slice(offset, e.len as usize) };
                e.disk = self.disk_append(RecordKind::Block, key, bytes, e.crc);
                if e.disk.is_some() {
                    self.stats.evicted_demoted += 1;
                }
            }
            if e.disk.is_some() {
                self.index.insert(key, e);
            } else {
                self.stats.evicted_dropped += 1;
                self.index.remove(&key);
                self.ns_stats[key.namespace as usize].blocks -= 1;
            }
        }
        arena.bump_generation(State::generation_index(arena, slot));
        self.with_slot(slot, |m| {
            m.state = SlotState::Free;
            m.visited = false;
        });
    }

    /// Appends a record to the NVMe tier, rolling segments as needed.
    fn disk_append(
        &mut self,
        kind: RecordKind,
        key: Key,
        value: &[u8],
        crc: u32,
    ) -> Option<DiskLoc> {
        let ns_len = self.ns_names[key.namespace as usize].len();
        let rl = disk::record_len(ns_len, value.len() as u64);
        if self.disk.as_ref()?.needs_new_segment(rl) && !self.roll_segment() {
            self.stats.demote_dropped += 1;
            return None;
        }
        let disk = self.disk.as_mut()?;
        let name = &self.ns_names[key.namespace as usize];
        let Some(loc) = disk.append(kind, name, &key.digest, value, crc) else {
            self.stats.demote_dropped += 1;
            return None;
        };
        if kind == RecordKind::Block {
            if let Some(seg) = disk.segment_mut(loc.segment) {
                seg.keys.push(key);
            }
        }
        Some(loc)
    }

    /// Starts a new segment; when the tier is full the oldest segment goes,
    /// its pinned blocks copied forward first.
    fn roll_segment(&mut self) -> bool {
        let Some(disk) = self.disk.as_mut() else {
            return false;
        };
        let oldest = if disk.full() { disk.pop_oldest() } else { None };
        if let Err(error) = disk.start_segment() {
            tracing::warn!(%error, "could not start a KV segment");
            if let Some(seg) = oldest {
                self.drop_segment(seg);
            }
            return false;
        }
        if let Some(seg) = oldest {
            self.drop_segment(seg);
        }
        true
    }

    fn drop_segment(&mut self, seg: disk::Segment) {
        self.stats.disk_segments_dropped += 1;
        for key in &seg.keys {
            let Some(mut e) = self.index.get(key).copied() else {
                continue;
            };
            let Some(loc) = e.disk.filter(|l| l.segment == seg.id) else {
                continue;
            };
            e.disk = None;
            if e.ram == NO_SLOT && e.pins > 0 {
                // Pinned (an expired lease counts too: cheap to be safe) and
                // only here: copy it forward into the new segment.
                let ns_len = self.ns_names[key.namespace as usize].len();
                let moved = DiskTier::read_record_sync(&seg, loc, ns_len, e.len)
                    .ok()
                    .and_then(|buf| {
                        let h = disk::decode_record_header(&buf, e.len)?;
                        let v = &buf[h.value_offset()..h.value_offset() + e.len as usize];
                        (h.digest == key.digest && crc32c(v) == e.crc).then(|| v.to_vec())
                    })
                    .and_then(|v| {
                        let rl = disk::record_len(ns_len, e.len);
                        let d = self.disk.as_mut()?;
                        if d.needs_new_segment(rl) {
                            return None;
                        }
                        let name = &self.ns_names[key.namespace as usize];
                        let loc = d.append(RecordKind::Block, name, &key.digest, &v, e.crc)?;
                        if let Some(s) = d.segment_mut(loc.segment) {
                            s.keys.push(*key);
                        }
                        Some(loc)
                    });
                e.disk = moved;
                if moved.is_some() {
                    self.stats.pinned_relocated += 1;
                }
            }
            if e.ram == NO_SLOT && e.disk.is_none() {
                self.stats.disk_blocks_dropped += 1;
                self.forget(*key);
            } else {
                self.index.insert(*key, e);
            }
        }
        DiskTier::delete_segment(seg);
    }

    /// Removes an index entry that has no RAM copy.
    fn forget(&mut self, key: Key) {
        if self.index.remove(&key).is_some() {
            self.ns_stats[key.namespace as usize].blocks -= 1;
        }
    }

    /// Deletes a block from both tiers. A slot being sent stays until its
    /// last reader lets go; a disk copy gets a tombstone so a restart does
    /// not bring it back.
    fn remove_entry(&mut self, arena: &Arena, key: Key) -> bool {
        let Some(e) = self.index.remove(&key) else {
            return false;
        };
        self.ns_stats[key.namespace as usize].blocks -= 1;
        if e.ram != NO_SLOT {
            let class = self.slot_class(e.ram);
            self.list_remove(e.ram);
            self.classes[class].live_bytes -= e.len;
            if self.meta(e.ram).readers > 0 {
                self.with_slot(e.ram, |m| m.state = SlotState::Dying);
            } else {
                self.free_slot(arena, e.ram);
            }
        }
        if e.disk.is_some() {
            self.disk_append(RecordKind::Tombstone, key, &[], 0);
        }
        true
    }

    fn release_read(&mut self, arena: &Arena, slot: u32) {
        self.with_slot(slot, |m| m.readers = m.readers.saturating_sub(1));
        let m = self.meta(slot);
        if m.readers == 0 && m.state == SlotState::Dying {
            self.free_slot(arena, slot);
        }
    }

    fn unpin_one(&mut self, key: Key) {
        if let Some(e) = self.index.get_mut(&key) {
            e.pins = e.pins.saturating_sub(1);
            if e.pins == 0 {
                e.pin_until_ms = 0;
            }
        }
    }

    /// Returns a slot to its class's free list.
    fn free_slot(&mut self, arena: &Arena, slot: u32) {
        arena.bump_generation(State::generation_index(arena, slot));
        let class = self.slot_class(slot);
        self.with_slot(slot, |m| {
            m.state = SlotState::Free;
            m.visited = false;
            m.readers = 0;
        });
        self.classes[class].free.push(slot);
        let p = slot_parts(slot).0;
        let page = &mut self.pages[p];
        page.used -= 1;
        if page.used == 0 {
            page.newest = 0;
        }
        self.page_changed(p);
    }

    fn make_live(&mut self, slot: u32, key: Key, len: u64) {
        self.with_slot(slot, |m| {
            m.key = key;
            m.state = SlotState::Live;
            m.visited = false;
            m.reads = 0;
        });
        self.stamp(slot);
        let class = self.slot_class(slot);
        self.classes[class].live_bytes += len;
        self.list_push_head(slot);
    }

    fn list_push_head(&mut self, slot: u32) {
        let class = self.slot_class(slot);
        let head = self.classes[class].head;
        {
            let m = self.meta_mut(slot);
            m.prev = NO_SLOT;
            m.next = head;
        }
        if head != NO_SLOT {
            self.meta_mut(head).prev = slot;
        }
        let c = &mut self.classes[class];
        c.head = slot;
        if c.tail == NO_SLOT {
            c.tail = slot;
        }
        c.live += 1;
    }

    fn list_remove(&mut self, slot: u32) {
        let class = self.slot_class(slot);
        let (prev, next) = {
            let m = self.meta(slot);
            (m.prev, m.next)
        };
        if prev != NO_SLOT {
            self.meta_mut(prev).next = next;
        }
        if next != NO_SLOT {
            self.meta_mut(next).prev = prev;
        }
        let c = &mut self.classes[class];
        if c.head == slot {
            c.head = next;
        }
        if c.tail == slot {
            c.tail = prev;
        }
        if c.hand == slot {
            c.hand = prev;
        }
        c.live -= 1;
        let m = self.meta_mut(slot);
        m.prev = NO_SLOT;
        m.next = NO_SLOT;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_ladder_is_increasing_and_covers_max() {
        let s = class_sizes(4 << 20);
        assert_eq!(s[0], SLOT_MIN_BYTES);
        assert_eq!(*s.last().unwrap(), 4 << 20);
        assert!(s
            .windows(2)
            .all(|w| w[0] < w[1] && (w[1] as f64) <= w[0] as f64 * 1.25 + 4096.0));
        assert!(s.iter().all(|x| x % 4096 == 0));
        assert_eq!(class_sizes(100), vec![4096]);
    }
}

#[cfg(test)]
mod mixed_history {
    //! Issue 19: after a long mix of sizes, gets, puts and pins had filled
    //! the RAM tier, a store of new blocks of one size kept only the last
    //! few: that size's class was held to a "fair share" of pages and
    //! evicted its own new blocks while other classes kept old ones.
    use super::*;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    fn digest(tag: u64, i: u64) -> Digest {
        let mut d = [0u8; 32];
        d[..8].copy_from_slice(&tag.to_le_bytes());
        d[8..16].copy_from_slice(&i.to_le_bytes());
        d
    }

    fn put(e: &Engine, ns: u32, d: &Digest, len: usize) -> Status {
        let (token, off) = match e.reserve(1, ns, d, len as u64) {
            Ok(r) => r,
            Err(s) => return s,
        };
        let v = vec![d[8] ^ d[0]; len];
        // SAFETY: the reservation's range, ours until commit.
        unsafe { e.arena().slice_mut(off, len) }.copy_from_slice(&v);
        e.commit(1, token, crc32c(&v), true)
    }

    /// RAM: the block is in the RAM tier (not only on disk, not gone).
    fn in_ram(e: &Engine, ns: u32, d: &Digest) -> bool {
        let mut out = Vec::new();
        e.plan_reads(
            ns,
            &[GetEntry {
                digest: *d,
                offset: 0,
                length: 0,
            }],
            false,
            &mut out,
        );
        matches!(out[0], ReadPlan::Ram(_))
    }

    fn stat(e: &Engine, name: &str) -> u64 {
        e.stats(None)
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
            .unwrap_or_else(|| panic!("no stat {name}"))
    }

    fn config(disk: Option<&std::path::Path>) -> KvConfig {
        KvConfig {
            memory_bytes: 128 << 20,
            value_max_bytes: 4 << 20,
            disk_dir: disk.map(|d| d.to_path_buf()),
            disk_bytes: 256 << 20,
            segment_bytes: 32 << 20,
            huge_pages: HugePages::Auto,
            part_timeout: PART_TIMEOUT_DEFAULT,
        }
    }

    /// Sizes an LMCache and `tarn bench kv` mix produces: whole blocks of
    /// two sizes, partial last chunks, small metadata values.
    const SIZES: [usize; 9] = [
        4 << 10,
        16 << 10,
        60 << 10,
        100 << 10,
        256 << 10,
        300 << 10,
        1 << 20,
        2 << 20,
        3 << 20,
    ];

    /// Replays a mixed history until well past full.
    fn replay(e: &Engine, ns: u32, rng: &mut Rng) {
        let mut stored: Vec<(u64, usize)> = Vec::new();
        let mut pins: Vec<Key> = Vec::new();
        let mut out = Vec::new();
        let mut i = 0u64;
        let written_target = 6 * e.config().memory_bytes;
        let mut written = 0u64;
        while written < written_target {
            let roll = rng.below(100);
            if roll < 45 || stored.is_empty() {
                let len = SIZES[rng.below(SIZES.len() as u64) as usize];
                let d = digest(1, i);
                if put(e, ns, &d, len) == Status::Ok {
                    stored.push((i, len));
                    written += len as u64;
                }
                i += 1;
            } else if roll < 90 {
                let (j, _) = stored[rng.below(stored.len() as u64) as usize];
                let entries: Vec<GetEntry> = (0..4)
                    .map(|k| GetEntry {
                        digest: digest(1, j.saturating_sub(k)),
                        offset: 0,
                        length: 0,
                    })
                    .collect();
                e.plan_reads(ns, &entries, false, &mut Vec::new());
            } else if roll < 95 {
                let (j, _) = stored[rng.below(stored.len() as u64) as usize];
                if pins.len() < 8 {
                    e.pin(ns, &[digest(1, j)], 60_000, &mut out, &mut pins);
                }
            } else if roll < 98 {
                if let Some(k) = pins.pop() {
                    e.unpin(ns, &[k.digest], &mut out, &mut vec![k]);
                }
            } else {
                let (j, _) = stored.swap_remove(rng.below(stored.len() as u64) as usize);
                e.delete(ns, &[digest(1, j)], &mut out);
            }
        }
        for k in pins {
            e.unpin(ns, &[k.digest], &mut out, &mut vec![k]);
        }
    }

    fn new_blocks_stay(disk: Option<&std::path::Path>, seed: u64) {
        let e = Engine::open(config(disk)).unwrap();
        let ns = e.namespace(b"mixed").unwrap();
        let mut rng = Rng(seed);
        replay(&e, ns, &mut rng);
        assert!(
            stat(&e, "evicted_dropped") + stat(&e, "evicted_demoted") > 0,
            "the history must fill the store"
        );
        // New blocks of two sizes, about a third of RAM: every one must be
        // there, in RAM, right after.
        for (tag, len, count) in [(2u64, 2 << 20, 20u64), (3, 256 << 10, 60)] {
            let digests: Vec<Digest> = (0..count).map(|i| digest(tag, i)).collect();
            for d in &digests {
                assert_eq!(put(&e, ns, d, len), Status::Ok);
            }
            let kept = digests.iter().filter(|d| in_ram(&e, ns, d)).count();
            assert_eq!(
                kept,
                count as usize,
                "seed {seed}: of {count} new {len}-byte blocks only {kept} are in RAM: {:?}",
                e.stats(None)
            );
        }
    }

    /// One size after another, reading the old ones or not: each new size
    /// gets the memory of the old and keeps all of its blocks.
    #[test]
    fn simple_fills_keep_every_new_block() {
        let dir = tempfile::tempdir().unwrap();
        for (read_old, disk) in [(false, None), (true, None), (true, Some(dir.path()))] {
            let e = Engine::open(config(disk)).unwrap();
            let ns = e.namespace(b"fills").unwrap();
            for (tag, len) in [
                (10u64, 256 << 10),
                (11, 2 << 20),
                (12, 60 << 10),
                (13, 1 << 20),
            ] {
                // 3/4 of RAM each time.
                let count = (96 << 20) / len as u64;
                let digests: Vec<Digest> = (0..count).map(|i| digest(tag, i)).collect();
                for d in &digests {
                    assert_eq!(put(&e, ns, d, len), Status::Ok);
                    if read_old {
                        let old = digest(tag - 1, tag);
                        in_ram(&e, ns, &old);
                    }
                }
                let kept = digests.iter().filter(|d| in_ram(&e, ns, d)).count();
                assert_eq!(
                    kept, count as usize,
                    "size {len}, read_old {read_old}, disk {disk:?}"
                );
            }
            if disk.is_some() {
                // What RAM gave up went to the NVMe tier, but for demotions
                // that found the tier's write buffers all in flight (this
                // loop outruns the flusher; evictions never wait for I/O).
                assert!(stat(&e, "evicted_demoted") > 0);
                assert_eq!(stat(&e, "evicted_dropped"), stat(&e, "demote_dropped"));
            }
            let moved: u64 = e.class_reports().iter().map(|c| c.counters.pages_out).sum();
            assert!(moved > 0, "pages must have moved between classes");
            assert_eq!(moved, stat(&e, "pages_stolen"));
        }
    }

    /// Blocks read over and over keep their pages while one-off blocks of
    /// another size stream through (scan resistance across classes), and a
    /// pinned block stays through everything.
    #[test]
    fn hot_and_pinned_blocks_survive_a_stream_of_another_size() {
        let e = Engine::open(config(None)).unwrap();
        let ns = e.namespace(b"hot").unwrap();
        let hot: Vec<Digest> = (0..64).map(|i| digest(20, i)).collect();
        for d in &hot {
            assert_eq!(put(&e, ns, d, 256 << 10), Status::Ok);
        }
        let pinned = digest(21, 0);
        assert_eq!(put(&e, ns, &pinned, 4 << 10), Status::Ok);
        let (mut out, mut held) = (Vec::new(), Vec::new());
        e.pin(ns, &[pinned], 600_000, &mut out, &mut held);
        assert_eq!(out, vec![Status::Ok]);
        // 2 MiB one-offs, 8x RAM, with the hot set read every 8 of them.
        for i in 0..512u64 {
            assert_eq!(put(&e, ns, &digest(22, i), 2 << 20), Status::Ok);
            if i % 8 == 7 {
                let missing = hot.iter().filter(|d| !in_ram(&e, ns, d)).count();
                assert_eq!(missing, 0, "after {i} one-offs");
            }
        }
        assert!(in_ram(&e, ns, &pinned), "a pinned block was evicted");
        let reports = e.class_reports();
        let big = reports.iter().find(|c| c.slot_bytes == 2 << 20).unwrap();
        assert!(big.counters.evicted_room > 400, "{reports:?}");
        assert!(big.bytes <= 128 << 20);
    }

    #[test]
    fn a_full_store_keeps_new_blocks_after_a_mixed_history() {
        for seed in [0x9e37_79b9_7f4a_7c15, 42, 7_777_777] {
            new_blocks_stay(None, seed);
        }
    }

    #[test]
    fn a_full_store_keeps_new_blocks_after_a_mixed_history_with_nvme() {
        let dir = tempfile::tempdir().unwrap();
        new_blocks_stay(Some(dir.path()), 0x1234_5678_9abc_def1);
    }

    /// Reads a block whole through the engine (RAM or NVMe tier) and
    /// checks it holds what `put` stored.
    fn read_back(e: &Engine, ns: u32, d: &Digest, len: usize) -> bool {
        let mut plan = Vec::new();
        let entry = GetEntry {
            digest: *d,
            offset: 0,
            length: 0,
        };
        e.plan_reads(ns, &[entry], false, &mut plan);
        let want = vec![d[8] ^ d[0]; len];
        match plan.pop() {
            Some(ReadPlan::Ram(r)) => {
                // SAFETY: a planned RAM read's range holds the committed value.
                let v = unsafe { e.arena().slice(r.value_offset, r.value_len as usize) };
                v == want.as_slice()
            }
            Some(ReadPlan::Disk(read)) => {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .build()
                    .unwrap();
                rt.block_on(e.read_disk(&read))
                    .is_ok_and(|b| b.value() == want.as_slice())
            }
            _ => false,
        }
    }

    #[test]
    fn a_clean_stop_writes_ram_only_blocks_to_nvme_and_a_restart_finds_them() {
        let dir = tempfile::tempdir().unwrap();
        // More than the flusher's buffers hold at once: the spill waits.
        let blocks: Vec<(Digest, usize)> = (0..120u64)
            .map(|i| (digest(7, i), [4096, 300 << 10, 1 << 20][i as usize % 3]))
            .collect();
        let deleted = digest(7, 1_000);
        {
            let e = Engine::open(config(Some(dir.path()))).unwrap();
            let ns = e.namespace(b"spill").unwrap();
            for (d, len) in &blocks {
                assert_eq!(put(&e, ns, d, *len), Status::Ok);
            }
            assert_eq!(put(&e, ns, &deleted, 4096), Status::Ok);
            e.delete(ns, &[deleted], &mut Vec::new());
            assert_eq!(stat(&e, "evicted_demoted"), 0, "everything fits in RAM");
            let total: u64 = blocks.iter().map(|(_, l)| *l as u64).sum();
            assert_eq!(e.spill_to_disk(), (blocks.len() as u64, total));
            // Spilled blocks stay served from RAM; a second spill has nothing to do.
            assert!(blocks.iter().all(|(d, _)| in_ram(&e, ns, d)));
            assert_eq!(e.spill_to_disk(), (0, 0));
            assert_eq!(stat(&e, "demote_dropped"), 0);
        }
        let e = Engine::open(config(Some(dir.path()))).unwrap();
        let ns = e.namespace(b"spill").unwrap();
        for (d, len) in &blocks {
            assert!(
                read_back(&e, ns, d, *len),
                "block {} lost by the restart",
                d[8]
            );
        }
        let mut out = Vec::new();
        e.exists(ns, &[deleted], &mut out);
        assert_eq!(out, [false], "a deleted block must not come back");
        // Without an NVMe tier there is nothing to write to.
        let ram = Engine::open(config(None)).unwrap();
        let ns = ram.namespace(b"spill").unwrap();
        assert_eq!(put(&ram, ns, &blocks[0].0, 4096), Status::Ok);
        assert_eq!(ram.spill_to_disk(), (0, 0));
    }
}
