//! A drive of another node, reached over RPC (`RemoteDrive`, the second
//! implementation of `tarn_store::drive_io::Drive`), and the node's side
//! that serves its own drives to the others (`DriveService`).

use std::collections::HashSet;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tarn_io::AlignedBuf;
use tarn_store::codec::StripeGeometry;
use tarn_store::drive::{BulkItem, MissedEntry, MissedPage, ObjectWrite};
use tarn_store::drive_io::{
    BoxFuture, Drive, DriveState, ListEntries, ShardPlace, ShardSink, ShardSource,
};
use tarn_store::format::{
    id_to_hex, BucketRecord, Id128, ObjectRecord, UploadPartRecord, UploadRecord,
};
use tarn_store::lock::{LeaseCall, LeaseTable};
use tarn_store::shard::ShardError;
use tarn_store::StoreError;

use crate::rpc::server::{Handler, HandlerError, ServerCall, EPOCH_CATCH_UP, EPOCH_POLL};
use crate::rpc::wire::drive::{self as dw, Failure};
use crate::rpc::wire::{op, Channel, Dec, Enc, ErrorCode};
use crate::rpc::{Call, RpcClient, RpcError};

/// Deadline of a metadata call on another node's drive: one that misses it
/// makes the node suspect (routed around at once, `rpc::client::Peer`).
pub const CONTROL_DEADLINE: Duration = Duration::from_secs(1);
/// Deadline of a call whose answer is a list (a page of keys, every key of
/// a bucket): long in all, each frame within the control step limit.
pub const SCAN_DEADLINE: Duration = Duration::from_secs(120);
/// The most missed-write entries one page of the log carries.
const MISSED_PAGE_MAX: usize = 10_000;

/// Deadline of a shard stream (a whole shard file written or read).
pub const BULK_DEADLINE: Duration = Duration::from_secs(600);

/// A drive of another node.
#[derive(Clone)]
pub struct RemoteDrive {
    client: Arc<RpcClient>,
    address: String,
    node_id: String,
    drive_id: Id128,
    epoch: Arc<AtomicU64>,
    /// The epoch of the map that placed the drive in this node's sets.
    since: u64,
    name: String,
}

impl RemoteDrive {
    /// `epoch` is this node's map epoch, which every call carries; `since`
    /// the epoch of the map that placed the drive where this node uses it.
    pub fn new(
        client: Arc<RpcClient>,
        address: &str,
        node_id: &str,
        drive_id: Id128,
        epoch: Arc<AtomicU64>,
        since: u64,
    ) -> RemoteDrive {
        RemoteDrive {
            client,
            address: address.to_string(),
            node_id: node_id.to_string(),
            drive_id,
            epoch,
            since,
            name: format!("{node_id}:{}", id_to_hex(&drive_id)),
        }
    }

    /// The epoch a call carries: this node's, and never less than the map's
    /// that placed the drive. A node applies a map's sets a moment before it
    /// takes the map's epoch, and a call made in that moment must not reach
    /// the drive's node as one of the old map (which may not place the drive
    /// yet, or not there): with the new epoch it waits there for the map.
    fn call_epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed).max(self.since)
    }

    /// A call on a connection to the drive's node.
    async fn open(&self, channel: Channel, deadline: Duration) -> Result<Call, RpcError> {
        self.client
            .open(&self.address, Some(&self.node_id), channel, deadline)
            .await
    }

    fn request(&self) -> Enc {
        let mut e = Enc::new();
        e.fixed(&self.drive_id);
        e
    }

    fn failure(&self, e: RpcError) -> Failure {
        match e {
            RpcError::Remote {
                code: ErrorCode::Failed,
                message,
            } => Failure::from_message(&message),
            // One missed deadline is no proof the node is gone (it is
            // probed: `rpc::client::Peer`); the write counts as missed and
            // a read as unanswered, but the drive stays in this node's view.
            RpcError::Deadline if !self.client.is_suspect(&self.address) => {
                Failure::Late(format!("node {}: no answer in time", self.node_id))
            }
            e if node_gone(&e) => Failure::Away(format!("node {}: {e}", self.node_id)),
            other => Failure::Offline(format!("node {}: {other}", self.node_id)),
        }
    }

    async fn call(&self, op: u16, payload: Vec<u8>) -> Result<Vec<u8>, Failure> {
        let mut retried = false;
        loop {
            let r = self
                .client
                .call(
                    &self.address,
                    Some(&self.node_id),
                    op,
                    self.call_epoch(),
                    &payload,
                    CONTROL_DEADLINE,
                )
                .await;
            match r {
                Err(e) if !retried && self.caught_up(&e).await => retried = true,
                r => return r.map_err(|e| self.failure(e)),
            }
        }
    }

    /// After a refusal for a stale epoch: whether this node's map reached
    /// the peer's epoch within a moment (the map change reaches nodes a few
    /// milliseconds apart), so the call is worth making again.
    async fn caught_up(&self, e: &RpcError) -> bool {
        let RpcError::StaleEpoch { peer_epoch } = e else {
            return false;
        };
        let until = tokio::time::Instant::now() + EPOCH_CATCH_UP;
        while self.epoch.load(Ordering::Acquire) < *peer_epoch {
            if tokio::time::Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(EPOCH_POLL).await;
        }
        true
    }

    async fn meta(&self, op: u16, payload: Vec<u8>) -> Result<Vec<u8>, StoreError> {
        self.call(op, payload)
            .await
            .map_err(|f| f.into_store(&self.name))
    }

    /// A call whose answer is a list: the runs of encoded items of its body.
    async fn list(&self, op: u16, payload: Vec<u8>) -> Result<Vec<Vec<u8>>, StoreError> {
        Ok(self.list_with_head(op, payload).await?.1)
    }

    /// A list call whose response payload says something of the list (its
    /// head), then the runs of its body.
    async fn list_with_head(
        &self,
        op: u16,
        payload: Vec<u8>,
    ) -> Result<(Vec<u8>, Vec<Vec<u8>>), StoreError> {
        let fail = |e: RpcError| self.failure(e).into_store(&self.name);
        let mut retried = false;
        let (mut call, head, body) = loop {
            let mut call = self
                .open(Channel::Control, SCAN_DEADLINE)
                .await
                .map_err(fail)?;
            call.request(op, self.call_epoch(), &payload, false)
                .await
                .map_err(fail)?;
            match call.response().await {
                Ok((head, body)) => break (call, head, body),
                Err(e) if !retried && self.caught_up(&e).await => retried = true,
                Err(e) => return Err(fail(e)),
            }
        };
        let mut runs = Vec::new();
        if body {
            let mut buf = Vec::new();
            while call.next_data(&mut buf).await.map_err(fail)? {
                runs.push(std::mem::take(&mut buf));
            }
        }
        call.finish();
        Ok((head, runs))
    }

    fn decoded<T>(
        &self,
        runs: Vec<Vec<u8>>,
        mut item: impl FnMut(&mut Dec<'_>) -> Result<T, crate::rpc::wire::WireError>,
    ) -> Result<Vec<T>, StoreError> {
        let mut out = Vec::new();
        for run in &runs {
            let mut d = Dec::new(run);
            while d.remaining() > 0 {
                out.push(item(&mut d).map_err(|e| self.malformed(e))?);
            }
        }
        Ok(out)
    }

    fn malformed(&self, e: impl std::fmt::Display) -> StoreError {
        StoreError::Drive {
            drive: self.name.clone(),
            reason: format!("malformed answer: {e}"),
        }
    }

    fn flag(&self, answer: &[u8]) -> Result<bool, StoreError> {
        match answer {
            [0] => Ok(false),
            [1] => Ok(true),
            _ => Err(self.malformed("expected a flag")),
        }
    }
}

fn decode_record<T, E: std::fmt::Display>(
    d: &mut Dec<'_>,
    decode: impl Fn(&[u8]) -> Result<T, E>,
) -> Result<T, crate::rpc::wire::WireError> {
    decode(d.bytes()?).map_err(|_| crate::rpc::wire::WireError::Invalid("record"))
}

impl Drive for RemoteDrive {
    fn name(&self) -> &str {
        &self.name
    }

    fn state(&self) -> BoxFuture<'_, Result<DriveState, StoreError>> {
        Box::pin(async move {
            let answer = self.meta(op::DRIVE_STATE, self.request().finish()).await?;
            match answer.as_slice() {
                [0] => Ok(DriveState::Offline),
                [1] => Ok(DriveState::Rebuilding),
                [2] => Ok(DriveState::Ready),
                _ => Err(self.malformed("a drive state that is not 0, 1 or 2")),
            }
        })
    }

    fn buckets(&self) -> BoxFuture<'_, Result<Vec<(String, BucketRecord)>, StoreError>> {
        Box::pin(async move {
            let runs = self
                .list(op::DRIVE_BUCKETS, self.request().finish())
                .await?;
            self.decoded(runs, |d| {
                Ok((
                    d.str()?.to_string(),
                    decode_record(d, BucketRecord::decode)?,
                ))
            })
        })
    }

    fn put_bucket(&self, name: String, rec: BucketRecord) -> BoxFuture<'_, Result<(), StoreError>> {
        let mut e = self.request();
        e.str(&name).bytes(&rec.encode());
        Box::pin(async move { self.meta(op::DRIVE_PUT_BUCKET, e.finish()).await.map(drop) })
    }

    fn delete_bucket(&self, name: String) -> BoxFuture<'_, Result<(), StoreError>> {
        let mut e = self.request();
        e.str(&name);
        Box::pin(async move {
            self.meta(op::DRIVE_DELETE_BUCKET, e.finish())
                .await
                .map(drop)
        })
    }

    fn bucket_has_entries(
        &self,
        bucket: String,
        uploads: bool,
    ) -> BoxFuture<'_, Result<bool, StoreError>> {
        let mut e = self.request();
        e.str(&bucket).u8(uploads as u8);
        Box::pin(async move {
            let a = self.meta(op::DRIVE_BUCKET_HAS_ENTRIES, e.finish()).await?;
            self.flag(&a)
        })
    }

    fn object(
        &self,
        bucket: String,
        key: String,
    ) -> BoxFuture<'_, Result<Option<ObjectRecord>, StoreError>> {
        let mut e = self.request();
        e.str(&bucket).str(&key);
        Box::pin(async move {
            let a = self.meta(op::DRIVE_OBJECT, e.finish()).await?;
            if a.is_empty() {
                return Ok(None);
            }
            ObjectRecord::decode(&a)
                .map(Some)
                .map_err(|e| StoreError::CorruptMetadata {
                    drive: self.name.clone(),
                    what: format!("{bucket}/{key}: {e}"),
                })
        })
    }

    fn write_object(
        &self,
        bucket: String,
        key: String,
        w: Arc<ObjectWrite>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        let mut e = self.request();
        e.str(&bucket).str(&key);
        dw::object_write(&mut e, &w);
        Box::pin(async move {
            self.meta(op::DRIVE_WRITE_OBJECT, e.finish())
                .await
                .map(drop)
        })
    }

    fn write_objects_bulk(
        &self,
        bucket: String,
        items: Arc<Vec<BulkItem>>,
        range: Range<usize>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let items = items
                .get(range)
                .ok_or_else(|| StoreError::InvalidArgument("bulk range out of bounds".into()))?;
            // In messages under the limit, each one batch on the drive.
            let mut start = 0;
            while start < items.len() {
                let mut e = self.request();
                e.str(&bucket);
                let mut n = 0;
                let mut body = Enc::new();
                for item in &items[start..] {
                    if n > 0 && body.buf.len() > (8 << 20) {
                        break;
                    }
                    dw::bulk_item(&mut body, item);
                    n += 1;
                }
                e.u32(n as u32).fixed(&body.finish());
                self.meta(op::DRIVE_WRITE_OBJECTS_BULK, e.finish()).await?;
                start += n;
            }
            Ok(())
        })
    }

    fn inline_data(
        &self,
        bucket: String,
        key: String,
        version: Id128,
        mod_time_ns: u64,
    ) -> BoxFuture<'_, Result<Option<Vec<u8>>, StoreError>> {
        let mut e = self.request();
        e.str(&bucket).str(&key).fixed(&version).u64(mod_time_ns);
        Box::pin(async move {
            let a = self.meta(op::DRIVE_INLINE_DATA, e.finish()).await?;
            match a.split_first() {
                Some((0, [])) => Ok(None),
                Some((1, data)) => Ok(Some(data.to_vec())),
                _ => Err(self.malformed("inline data")),
            }
        })
    }

    fn list_page(
        &self,
        bucket: String,
        prefix: String,
        from: Option<Vec<u8>>,
        limit: usize,
    ) -> BoxFuture<'_, Result<ListEntries, StoreError>> {
        let mut e = self.request();
        e.str(&bucket).str(&prefix);
        match &from {
            Some(f) => e.u8(1).bytes(f),
            None => e.u8(0),
        };
        e.u32(limit.min(u32::MAX as usize) as u32);
        Box::pin(async move {
            let runs = self.list(op::DRIVE_LIST_PAGE, e.finish()).await?;
            self.decoded(runs, |d| Ok((d.str()?.to_string(), d.bytes()?.to_vec())))
        })
    }

    fn all_object_keys(&self, bucket: String) -> BoxFuture<'_, Result<Vec<String>, StoreError>> {
        let mut e = self.request();
        e.str(&bucket);
        Box::pin(async move {
            let runs = self.list(op::DRIVE_ALL_OBJECT_KEYS, e.finish()).await?;
            self.decoded(runs, |d| Ok(d.str()?.to_string()))
        })
    }

    fn put_upload(
        &self,
        bucket: String,
        key: String,
        rec: UploadRecord,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        let mut e = self.request();
        e.str(&bucket).str(&key).bytes(&rec.encode());
        Box::pin(async move { self.meta(op::DRIVE_PUT_UPLOAD, e.finish()).await.map(drop) })
    }

    fn upload(
        &self,
        bucket: String,
        key: String,
        upload_id: Id128,
    ) -> BoxFuture<'_, Result<Option<UploadRecord>, StoreError>> {
        let mut e = self.request();
        e.str(&bucket).str(&key).fixed(&upload_id);
        Box::pin(async move {
            let a = self.meta(op::DRIVE_UPLOAD, e.finish()).await?;
            if a.is_empty() {
                return Ok(None);
            }
            UploadRecord::decode(&a)
                .map(Some)
                .map_err(|e| StoreError::CorruptMetadata {
                    drive: self.name.clone(),
                    what: format!("upload {}: {e}", id_to_hex(&upload_id)),
                })
        })
    }

    fn delete_upload(
        &self,
        bucket: String,
        key: String,
        upload_id: Id128,
        parts: Vec<u32>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        let mut e = self.request();
        e.str(&bucket)
            .str(&key)
            .fixed(&upload_id)
            .u32(parts.len() as u32);
        for p in &parts {
            e.u32(*p);
        }
        Box::pin(async move {
            self.meta(op::DRIVE_DELETE_UPLOAD, e.finish())
                .await
                .map(drop)
        })
    }

    fn scan_uploads(
        &self,
        bucket: String,
        prefix: String,
        limit: usize,
    ) -> BoxFuture<'_, Result<Vec<(String, UploadRecord)>, StoreError>> {
        let mut e = self.request();
        e.str(&bucket).str(&prefix).u64(limit as u64);
        Box::pin(async move {
            let runs = self.list(op::DRIVE_SCAN_UPLOADS, e.finish()).await?;
            self.decoded(runs, |d| {
                Ok((
                    d.str()?.to_string(),
                    decode_record(d, UploadRecord::decode)?,
                ))
            })
        })
    }

    fn put_part(
        &self,
        upload_id: Id128,
        part: UploadPartRecord,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        let mut e = self.request();
        e.fixed(&upload_id).bytes(&part.encode());
        Box::pin(async move { self.meta(op::DRIVE_PUT_PART, e.finish()).await.map(drop) })
    }

    fn parts(&self, upload_id: Id128) -> BoxFuture<'_, Result<Vec<UploadPartRecord>, StoreError>> {
        let mut e = self.request();
        e.fixed(&upload_id);
        Box::pin(async move {
            let runs = self.list(op::DRIVE_PARTS, e.finish()).await?;
            self.decoded(runs, |d| decode_record(d, UploadPartRecord::decode))
        })
    }

    fn referenced_data_ids(&self) -> BoxFuture<'_, Result<HashSet<Id128>, StoreError>> {
        Box::pin(async move {
            let runs = self
                .list(op::DRIVE_REFERENCED_DATA_IDS, self.request().finish())
                .await?;
            Ok(self
                .decoded(runs, |d| d.fixed::<16>())?
                .into_iter()
                .collect())
        })
    }

    fn create_shard(
        &self,
        data_id: Id128,
        shard_index: u8,
        place: ShardPlace,
    ) -> BoxFuture<'_, std::io::Result<Box<dyn ShardSink>>> {
        let mut e = self.request();
        e.fixed(&data_id).u8(shard_index).u8(match place {
            ShardPlace::Final => 0,
            ShardPlace::Tmp => 1,
        });
        Box::pin(async move {
            let io = |e: RpcError| self.failure(e).into_io();
            let mut call = self.open(Channel::Bulk, BULK_DEADLINE).await.map_err(io)?;
            call.request(op::SHARD_WRITE, self.call_epoch(), &e.finish(), true)
                .await
                .map_err(io)?;
            Ok(Box::new(RemoteShardSink {
                call,
                node: self.node_id.clone(),
            }) as Box<dyn ShardSink>)
        })
    }

    fn commit_shard(&self, tmp_id: Id128, data_id: Id128) -> BoxFuture<'_, std::io::Result<()>> {
        let mut e = self.request();
        e.fixed(&tmp_id).fixed(&data_id);
        Box::pin(async move {
            self.call(op::SHARD_COMMIT, e.finish())
                .await
                .map(drop)
                .map_err(Failure::into_io)
        })
    }

    fn open_shard(
        &self,
        data_id: Id128,
        geometry: StripeGeometry,
    ) -> BoxFuture<'_, Result<Box<dyn ShardSource>, ShardError>> {
        let mut e = self.request();
        e.fixed(&data_id);
        geometry_enc(&mut e, &geometry);
        Box::pin(async move {
            self.call(op::SHARD_OPEN, e.finish())
                .await
                .map_err(Failure::into_shard)?;
            Ok(Box::new(RemoteShardSource {
                drive: self.clone(),
                data_id,
                geometry,
                last: 0,
                stream: None,
            }) as Box<dyn ShardSource>)
        })
    }

    fn remove_shards(&self, data_ids: Vec<Id128>) -> BoxFuture<'_, ()> {
        let mut e = self.request();
        e.u32(data_ids.len() as u32);
        for id in &data_ids {
            e.fixed(id);
        }
        Box::pin(async move {
            if let Err(f) = self.call(op::SHARD_REMOVE, e.finish()).await {
                tracing::warn!(drive = %self.name, failure = ?f, "could not remove shard files");
            }
        })
    }

    fn lease(&self, call: LeaseCall) -> BoxFuture<'_, Result<bool, StoreError>> {
        let mut e = self.request();
        dw::lease_call(&mut e, &call);
        Box::pin(async move {
            let a = self.meta(op::DRIVE_LEASE, e.finish()).await?;
            self.flag(&a)
        })
    }

    fn log_missed(&self, entries: Arc<Vec<MissedEntry>>) -> BoxFuture<'_, Result<(), StoreError>> {
        let mut e = self.request();
        e.u32(entries.len() as u32);
        for m in entries.iter() {
            e.u8(m.position).str(&m.bucket).str(&m.key);
        }
        Box::pin(async move { self.meta(op::DRIVE_LOG_MISSED, e.finish()).await.map(drop) })
    }

    fn missed(
        &self,
        position: u8,
        after: Option<Vec<u8>>,
        max: usize,
    ) -> BoxFuture<'_, Result<MissedPage, StoreError>> {
        let mut e = self.request();
        e.u8(position).u32(max.min(u32::MAX as usize) as u32);
        match &after {
            Some(a) => e.u8(1).bytes(a),
            None => e.u8(0),
        };
        Box::pin(async move {
            let (head, runs) = self.list_with_head(op::DRIVE_MISSED, e.finish()).await?;
            let mut d = Dec::new(&head);
            let (overflow, more) = (|| {
                let overflow = match d.u8()? {
                    0 => None,
                    _ => Some(d.u64()?),
                };
                let more = d.u8()? != 0;
                d.end()?;
                Ok::<_, crate::rpc::wire::WireError>((overflow, more))
            })()
            .map_err(|e| self.malformed(e))?;
            let entries = self.decoded(runs, |d| {
                Ok((d.str()?.to_string(), d.str()?.to_string(), d.u64()?))
            })?;
            let page = MissedPage {
                entries,
                overflow,
                more,
            };
            Ok(page)
        })
    }

    fn clear_missed(
        &self,
        position: u8,
        done: Vec<(String, String, u64)>,
        before: Option<u64>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        let mut e = self.request();
        e.u8(position);
        match before {
            Some(t) => e.u8(1).u64(t),
            None => e.u8(0),
        };
        e.u32(done.len() as u32);
        for (b, k, at) in &done {
            e.str(b).str(k).u64(*at);
        }
        Box::pin(async move {
            self.meta(op::DRIVE_CLEAR_MISSED, e.finish())
                .await
                .map(drop)
        })
    }
}

fn geometry_enc(e: &mut Enc, g: &StripeGeometry) {
    e.u64(g.part_size).u64(g.stripe_size).u64(g.data_shards);
}

/// The largest part a shard request may describe: far above any object
/// (S3 allows 5 TiB), low enough that no length or count derived from it
/// overflows, so a forged geometry is refused before any arithmetic on it.
const PART_SIZE_MAX_BYTES: u64 = 1 << 50;

fn geometry_dec(d: &mut Dec<'_>) -> Result<StripeGeometry, crate::rpc::wire::WireError> {
    let g = StripeGeometry {
        part_size: d.u64()?,
        stripe_size: d.u64()?,
        data_shards: d.u64()?,
    };
    let bad = g.part_size > PART_SIZE_MAX_BYTES
        || g.data_shards == 0
        || g.data_shards > 255
        || g.stripe_size == 0
        || g.stripe_size > tarn_store::format::STRIPE_SIZE_MAX_BYTES as u64;
    if bad {
        return Err(crate::rpc::wire::WireError::Invalid("stripe geometry"));
    }
    Ok(g)
}

struct RemoteShardSink {
    call: Call,
    node: String,
}

impl ShardSink for RemoteShardSink {
    fn write_block(&mut self, buf: AlignedBuf) -> BoxFuture<'_, (std::io::Result<()>, AlignedBuf)> {
        Box::pin(async move {
            let r = self.call.send_data(&buf).await;
            (r.map_err(|e| rpc_io(&self.node, e)), buf)
        })
    }

    fn finish(self: Box<Self>) -> BoxFuture<'static, std::io::Result<()>> {
        Box::pin(async move {
            let RemoteShardSink { mut call, node } = *self;
            call.end_body(&[]).await.map_err(|e| rpc_io(&node, e))?;
            call.response().await.map_err(|e| rpc_io(&node, e))?;
            call.finish();
            Ok(())
        })
    }
}

/// Whether an RPC error says the drive's node went away (refused the
/// connection, or closed or reset it: stopped, restarting, crashed) rather
/// than that the drive failed.
fn node_gone(e: &RpcError) -> bool {
    use std::io::ErrorKind as K;
    match e {
        RpcError::Unreachable { .. } | RpcError::Closed => true,
        RpcError::Io(io) => matches!(
            io.kind(),
            K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe | K::UnexpectedEof
        ),
        _ => false,
    }
}

fn rpc_io(node: &str, e: RpcError) -> std::io::Error {
    match e {
        RpcError::Remote {
            code: ErrorCode::Failed,
            message,
        } => Failure::from_message(&message).into_io(),
        e if node_gone(&e) => Failure::Away(format!("node {node}: {e}")).into_io(),
        other => std::io::Error::other(format!("node {node}: {other}")),
    }
}

/// Reads blocks as a stream: one call delivers blocks `next..=last` in order;
/// a read out of that order starts another.
struct RemoteShardSource {
    drive: RemoteDrive,
    data_id: Id128,
    geometry: StripeGeometry,
    last: u64,
    stream: Option<(Call, u64)>,
}

impl RemoteShardSource {
    async fn start(&mut self, first: u64) -> Result<(), ShardError> {
        let mut e = self.drive.request();
        e.fixed(&self.data_id);
        geometry_enc(&mut e, &self.geometry);
        e.u64(first).u64(self.last.max(first));
        let d = &self.drive;
        let shard = |e: RpcError| d.failure(e).into_shard();
        let mut call = d.open(Channel::Bulk, BULK_DEADLINE).await.map_err(shard)?;
        call.request(op::SHARD_READ, d.call_epoch(), &e.finish(), false)
            .await
            .map_err(shard)?;
        call.response().await.map_err(shard)?;
        self.stream = Some((call, first));
        Ok(())
    }
}

impl ShardSource for RemoteShardSource {
    fn load_checksums(&mut self, _first: u64, last: u64) -> BoxFuture<'_, Result<(), ShardError>> {
        // The drive's node checks every block against its own table.
        self.last = last;
        Box::pin(async { Ok(()) })
    }

    fn read_block(
        &mut self,
        j: u64,
        mut buf: AlignedBuf,
    ) -> BoxFuture<'_, (Result<(), ShardError>, AlignedBuf)> {
        Box::pin(async move {
            if !matches!(&self.stream, Some((_, next)) if *next == j) {
                self.stream = None;
                if let Err(e) = self.start(j).await {
                    return (Err(e), buf);
                }
            }
            let (call, next) = self.stream.as_mut().expect("started");
            let r = call.next_data(&mut buf).await;
            let want = self.geometry.shard_len(j) as usize;
            let r = match r {
                Ok(true) if buf.len() == want => {
                    *next += 1;
                    Ok(())
                }
                Ok(_) => Err(ShardError::BadFooter(
                    "the drive's node sent a short stream",
                )),
                Err(e) => Err(self.drive.failure(e).into_shard()),
            };
            if r.is_err() {
                self.stream = None;
            }
            (r, buf)
        })
    }

    fn verify_all(&mut self, shard_index: u8) -> BoxFuture<'_, Result<(), ShardError>> {
        let mut e = self.drive.request();
        e.fixed(&self.data_id);
        geometry_enc(&mut e, &self.geometry);
        e.u8(shard_index);
        Box::pin(async move {
            self.drive
                .call(op::SHARD_VERIFY, e.finish())
                .await
                .map(drop)
                .map_err(Failure::into_shard)
        })
    }
}

/// The drives a node serves to the others.
pub trait DriveProvider: Send + Sync + 'static {
    /// The epoch of the node's current cluster map.
    fn epoch(&self) -> u64;
    /// The drive for metadata reads: in service with a complete index.
    fn for_read(&self, drive_id: &Id128) -> Option<Arc<dyn Drive>>;
    /// The drive for writes and shard files: in service.
    fn for_write(&self, drive_id: &Id128) -> Option<Arc<dyn Drive>>;
    /// The drive's lease table, in service or not (None: no such drive
    /// here).
    fn leases(&self, drive_id: &Id128) -> Option<Arc<LeaseTable>>;
    /// Waits (briefly) until the node's drives can be asked: a node that
    /// found the cluster map a moment after its peers is opening them.
    fn ready(&self) -> impl std::future::Future<Output = ()> + Send {
        async {}
    }
    /// Reads the node's users and permissions again; whether they now
    /// apply (`op::NODE_RELOAD_DOCS`).
    fn reload_docs(&self) -> impl std::future::Future<Output = bool> + Send {
        async { false }
    }
}

/// Serves this node's drives over RPC.
pub struct DriveService<P> {
    pub provider: P,
}

fn failed(f: Failure) -> HandlerError {
    HandlerError::Failed(f.to_message())
}

/// Packs encoded items into data frames of about `LIST_FRAME_BYTES`.
async fn send_list<T>(
    call: &mut ServerCall<'_>,
    items: impl IntoIterator<Item = T>,
    encode: impl FnMut(&mut Enc, T),
) -> Result<(), HandlerError> {
    send_list_with_head(call, &[], items, encode).await
}

/// A list answer whose response payload is `head`.
async fn send_list_with_head<T>(
    call: &mut ServerCall<'_>,
    head: &[u8],
    items: impl IntoIterator<Item = T>,
    mut encode: impl FnMut(&mut Enc, T),
) -> Result<(), HandlerError> {
    call.reply_body(head).await?;
    let mut run = Enc::new();
    for item in items {
        encode(&mut run, item);
        if run.buf.len() >= dw::LIST_FRAME_BYTES {
            call.send_data(&std::mem::take(&mut run.buf)).await?;
        }
    }
    if !run.buf.is_empty() {
        call.send_data(&run.buf).await?;
    }
    call.end_body(&[]).await?;
    Ok(())
}

impl<P: DriveProvider> Handler for DriveService<P> {
    fn epoch(&self) -> u64 {
        self.provider.epoch()
    }

    async fn ready(&self) {
        self.provider.ready().await
    }

    async fn handle(&self, call: &mut ServerCall<'_>) -> Result<(), HandlerError> {
        let payload = std::mem::take(&mut call.payload);
        let mut d = Dec::new(&payload);
        if call.op == op::NODE_RELOAD_DOCS {
            d.end()?;
            let applied = self.provider.reload_docs().await;
            return Ok(call.reply(&[applied as u8]).await?);
        }
        let id: Id128 = d.fixed()?;
        if call.op == op::DRIVE_STATE {
            d.end()?;
            let state = if self.provider.for_read(&id).is_some() {
                2
            } else if self.provider.for_write(&id).is_some() {
                1
            } else {
                0
            };
            return Ok(call.reply(&[state]).await?);
        }
        if call.op == op::DRIVE_LEASE {
            let lease = dw::decode_lease_call(&mut d)?;
            let Some(table) = self.provider.leases(&id) else {
                return Err(failed(Failure::Offline(format!(
                    "drive {} is not a drive of this node",
                    id_to_hex(&id)
                ))));
            };
            let granted = table
                .call(lease)
                .await
                .map_err(|e| failed(Failure::of_store(&e)))?;
            return Ok(call.reply(&[granted as u8]).await?);
        }
        let reads = matches!(
            call.op,
            op::DRIVE_BUCKETS
                | op::DRIVE_BUCKET_HAS_ENTRIES
                | op::DRIVE_OBJECT
                | op::DRIVE_INLINE_DATA
                | op::DRIVE_LIST_PAGE
                | op::DRIVE_UPLOAD
                | op::DRIVE_SCAN_UPLOADS
                | op::DRIVE_PARTS
        );
        let drive = if reads {
            self.provider.for_read(&id)
        } else {
            self.provider.for_write(&id)
        };
        let Some(drive) = drive else {
            return Err(failed(Failure::Offline(format!(
                "drive {} is not in service on this node",
                id_to_hex(&id)
            ))));
        };
        let store = |e: StoreError| failed(Failure::of_store(&e));
        match call.op {
            op::DRIVE_BUCKETS => {
                d.end()?;
                let list = drive.buckets().await.map_err(store)?;
                send_list(call, list, |e, (name, rec)| {
                    e.str(&name).bytes(&rec.encode());
                })
                .await
            }
            op::DRIVE_PUT_BUCKET => {
                let name = d.str()?.to_string();
                let rec = BucketRecord::decode(d.bytes()?)
                    .map_err(|e| HandlerError::Malformed(e.to_string()))?;
                d.end()?;
                drive.put_bucket(name, rec).await.map_err(store)?;
                Ok(call.reply(&[]).await?)
            }
            op::DRIVE_DELETE_BUCKET => {
                let name = d.str()?.to_string();
                d.end()?;
                drive.delete_bucket(name).await.map_err(store)?;
                Ok(call.reply(&[]).await?)
            }
            op::DRIVE_BUCKET_HAS_ENTRIES => {
                let bucket = d.str()?.to_string();
                let uploads = d.u8()? != 0;
                d.end()?;
                let has = drive
                    .bucket_has_entries(bucket, uploads)
                    .await
                    .map_err(store)?;
                Ok(call.reply(&[has as u8]).await?)
            }
            op::DRIVE_OBJECT => {
                let (bucket, key) = (d.str()?.to_string(), d.str()?.to_string());
                d.end()?;
                let rec = drive.object(bucket, key).await.map_err(store)?;
                Ok(call
                    .reply(&rec.map(|r| r.encode()).unwrap_or_default())
                    .await?)
            }
            op::DRIVE_WRITE_OBJECT => {
                let (bucket, key) = (d.str()?.to_string(), d.str()?.to_string());
                let w = dw::decode_object_write(&mut d)?;
                d.end()?;
                drive
                    .write_object(bucket, key, Arc::new(w))
                    .await
                    .map_err(store)?;
                Ok(call.reply(&[]).await?)
            }
            op::DRIVE_WRITE_OBJECTS_BULK => {
                let bucket = d.str()?.to_string();
                let n = dw::count(&mut d, 9)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(dw::decode_bulk_item(&mut d)?);
                }
                d.end()?;
                let len = items.len();
                drive
                    .write_objects_bulk(bucket, Arc::new(items), 0..len)
                    .await
                    .map_err(store)?;
                Ok(call.reply(&[]).await?)
            }
            op::DRIVE_INLINE_DATA => {
                let (bucket, key) = (d.str()?.to_string(), d.str()?.to_string());
                let (version, mt) = (d.fixed::<16>()?, d.u64()?);
                d.end()?;
                let data = drive
                    .inline_data(bucket, key, version, mt)
                    .await
                    .map_err(store)?;
                let mut a = Vec::with_capacity(1 + data.as_ref().map_or(0, Vec::len));
                match data {
                    Some(data) => {
                        a.push(1);
                        a.extend_from_slice(&data);
                    }
                    None => a.push(0),
                }
                Ok(call.reply(&a).await?)
            }
            op::DRIVE_LIST_PAGE => {
                let (bucket, prefix) = (d.str()?.to_string(), d.str()?.to_string());
                let from = match d.u8()? {
                    0 => None,
                    1 => Some(d.bytes()?.to_vec()),
                    _ => return Err(HandlerError::Malformed("from flag".into())),
                };
                let limit = d.u32()? as usize;
                d.end()?;
                let page = drive
                    .list_page(bucket, prefix, from, limit.min(100_000))
                    .await
                    .map_err(store)?;
                send_list(call, page, |e, (k, v)| {
                    e.str(&k).bytes(&v);
                })
                .await
            }
            op::DRIVE_ALL_OBJECT_KEYS => {
                let bucket = d.str()?.to_string();
                d.end()?;
                let keys = drive.all_object_keys(bucket).await.map_err(store)?;
                send_list(call, keys, |e, k| {
                    e.str(&k);
                })
                .await
            }
            op::DRIVE_LOG_MISSED => {
                let mut entries = Vec::new();
                for _ in 0..dw::count(&mut d, 3)? {
                    entries.push(MissedEntry {
                        position: d.u8()?,
                        bucket: d.str()?.to_string(),
                        key: d.str()?.to_string(),
                    });
                }
                d.end()?;
                drive.log_missed(Arc::new(entries)).await.map_err(store)?;
                Ok(call.reply(&[]).await?)
            }
            op::DRIVE_MISSED => {
                let position = d.u8()?;
                let max = (d.u32()? as usize).min(MISSED_PAGE_MAX);
                let after = match d.u8()? {
                    0 => None,
                    _ => Some(d.bytes()?.to_vec()),
                };
                d.end()?;
                let page = drive.missed(position, after, max).await.map_err(store)?;
                let mut head = Enc::new();
                match page.overflow {
                    Some(t) => head.u8(1).u64(t),
                    None => head.u8(0),
                };
                head.u8(u8::from(page.more));
                send_list_with_head(call, &head.finish(), page.entries, |e, (b, k, at)| {
                    e.str(&b).str(&k).u64(at);
                })
                .await
            }
            op::DRIVE_CLEAR_MISSED => {
                let position = d.u8()?;
                let before = match d.u8()? {
                    0 => None,
                    _ => Some(d.u64()?),
                };
                let mut done = Vec::new();
                for _ in 0..dw::count(&mut d, 10)? {
                    done.push((d.str()?.to_string(), d.str()?.to_string(), d.u64()?));
                }
                d.end()?;
                drive
                    .clear_missed(position, done, before)
                    .await
                    .map_err(store)?;
                Ok(call.reply(&[]).await?)
            }
            op::DRIVE_PUT_UPLOAD => {
                let (bucket, key) = (d.str()?.to_string(), d.str()?.to_string());
                let rec = UploadRecord::decode(d.bytes()?)
                    .map_err(|e| HandlerError::Malformed(e.to_string()))?;
                d.end()?;
                drive.put_upload(bucket, key, rec).await.map_err(store)?;
                Ok(call.reply(&[]).await?)
            }
            op::DRIVE_UPLOAD => {
                let (bucket, key) = (d.str()?.to_string(), d.str()?.to_string());
                let upload_id = d.fixed::<16>()?;
                d.end()?;
                let rec = drive.upload(bucket, key, upload_id).await.map_err(store)?;
                Ok(call
                    .reply(&rec.map(|r| r.encode()).unwrap_or_default())
                    .await?)
            }
            op::DRIVE_DELETE_UPLOAD => {
                let (bucket, key) = (d.str()?.to_string(), d.str()?.to_string());
                let upload_id = d.fixed::<16>()?;
                let mut parts = Vec::new();
                for _ in 0..dw::count(&mut d, 4)? {
                    parts.push(d.u32()?);
                }
                d.end()?;
                drive
                    .delete_upload(bucket, key, upload_id, parts)
                    .await
                    .map_err(store)?;
                Ok(call.reply(&[]).await?)
            }
            op::DRIVE_SCAN_UPLOADS => {
                let (bucket, prefix) = (d.str()?.to_string(), d.str()?.to_string());
                let limit = d.u64()?.min(usize::MAX as u64) as usize;
                d.end()?;
                let list = drive
                    .scan_uploads(bucket, prefix, limit)
                    .await
                    .map_err(store)?;
                send_list(call, list, |e, (k, r)| {
                    e.str(&k).bytes(&r.encode());
                })
                .await
            }
            op::DRIVE_PUT_PART => {
                let upload_id = d.fixed::<16>()?;
                let part = UploadPartRecord::decode(d.bytes()?)
                    .map_err(|e| HandlerError::Malformed(e.to_string()))?;
                d.end()?;
                drive.put_part(upload_id, part).await.map_err(store)?;
                Ok(call.reply(&[]).await?)
            }
            op::DRIVE_PARTS => {
                let upload_id = d.fixed::<16>()?;
                d.end()?;
                let parts = drive.parts(upload_id).await.map_err(store)?;
                send_list(call, parts, |e, p| {
                    e.bytes(&p.encode());
                })
                .await
            }
            op::DRIVE_REFERENCED_DATA_IDS => {
                d.end()?;
                let ids = drive.referenced_data_ids().await.map_err(store)?;
                send_list(call, ids, |e, id| {
                    e.fixed(&id);
                })
                .await
            }
            op::SHARD_WRITE => {
                let data_id = d.fixed::<16>()?;
                let shard_index = d.u8()?;
                let place = match d.u8()? {
                    0 => ShardPlace::Final,
                    1 => ShardPlace::Tmp,
                    _ => return Err(HandlerError::Malformed("shard place".into())),
                };
                d.end()?;
                if !call.has_body() {
                    return Err(HandlerError::Malformed(
                        "a shard write without a body".into(),
                    ));
                }
                let io = |e: std::io::Error| failed(Failure::of_io(&e));
                let mut sink = drive
                    .create_shard(data_id, shard_index, place)
                    .await
                    .map_err(io)?;
                let mut block = AlignedBuf::with_capacity(0);
                while call.next_data(&mut block).await? {
                    let (r, b) = sink.write_block(block).await;
                    block = b;
                    r.map_err(io)?;
                }
                sink.finish().await.map_err(io)?;
                Ok(call.reply(&[]).await?)
            }
            op::SHARD_COMMIT => {
                let (tmp_id, data_id) = (d.fixed::<16>()?, d.fixed::<16>()?);
                d.end()?;
                drive
                    .commit_shard(tmp_id, data_id)
                    .await
                    .map_err(|e| failed(Failure::of_io(&e)))?;
                Ok(call.reply(&[]).await?)
            }
            op::SHARD_OPEN => {
                let data_id = d.fixed::<16>()?;
                let g = geometry_dec(&mut d)?;
                d.end()?;
                drive
                    .open_shard(data_id, g)
                    .await
                    .map_err(|e| failed(Failure::of_shard(&e)))?;
                Ok(call.reply(&[]).await?)
            }
            op::SHARD_READ => {
                let data_id = d.fixed::<16>()?;
                let g = geometry_dec(&mut d)?;
                let (first, last) = (d.u64()?, d.u64()?);
                d.end()?;
                if first > last || last >= g.stripe_count() {
                    return Err(HandlerError::Malformed("block range".into()));
                }
                let shard = |e: ShardError| failed(Failure::of_shard(&e));
                let mut source = drive.open_shard(data_id, g).await.map_err(shard)?;
                source.load_checksums(first, last).await.map_err(shard)?;
                call.reply_body(&[]).await?;
                let mut buf = AlignedBuf::with_capacity(g.shard_len(first) as usize);
                for j in first..=last {
                    let (r, b) = source.read_block(j, buf).await;
                    buf = b;
                    // Mid-body: an error frame ends the stream for the caller.
                    r.map_err(shard)?;
                    call.send_data(&buf).await?;
                }
                call.end_body(&[]).await?;
                Ok(())
            }
            op::SHARD_VERIFY => {
                let data_id = d.fixed::<16>()?;
                let g = geometry_dec(&mut d)?;
                let shard_index = d.u8()?;
                d.end()?;
                let shard = |e: ShardError| failed(Failure::of_shard(&e));
                let mut source = drive.open_shard(data_id, g).await.map_err(shard)?;
                source.verify_all(shard_index).await.map_err(shard)?;
                Ok(call.reply(&[]).await?)
            }
            op::SHARD_REMOVE => {
                let mut ids = Vec::new();
                for _ in 0..dw::count(&mut d, 16)? {
                    ids.push(d.fixed::<16>()?);
                }
                d.end()?;
                drive.remove_shards(ids).await;
                Ok(call.reply(&[]).await?)
            }
            other => Err(HandlerError::UnknownOp(other)),
        }
    }
}
