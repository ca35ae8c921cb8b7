//! Writes through a cache bucket (`--writes through`): each goes to the
//! upstream first; what the cache keeps of it becomes visible only once the
//! upstream acknowledged it.
//!
//! A PUT streams the body to the upstream and, as it passes, into chunks of
//! a fresh generation; the body's last piece is held back until its
//! checksums are verified, so a body that fails them never completes
//! upstream. After the upstream's answer, its HEAD must name the ETag the
//! PUT returned (no other writer came between) for the entry to point at
//! the new chunks; otherwise they are deleted and the object is fetched
//! when read.

use futures::StreamExt;

use super::*;
use crate::cache::upstream::ReqBody;

/// Pieces queued toward the upstream.
const UPLOAD_QUEUE: usize = 8;

impl CacheBucket {
    /// PUT through: (ETag, version id) as the upstream answered.
    pub async fn put_through(
        self: &Arc<Self>,
        key: &str,
        body: ObjectBody,
        headers: Vec<(String, String)>,
    ) -> Result<(String, Option<String>), CacheError> {
        let len = body.declared_len.ok_or_else(|| {
            CacheError::Invalid("a write through a cache needs the body's length".into())
        })?;
        let generation = format!("w{}", random_hex());
        let (tx, rx) = mpsc::channel(UPLOAD_QUEUE);
        let headers: Vec<(&str, String)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        let upload = self
            .upstream
            .put(key, len, &headers, Upstream::channel_body(rx));
        let feed = self.feed(body, tx, Some(&generation));
        let (answer, fed) = futures::join!(upload, feed);
        let stored = match (answer, fed) {
            (Ok(a), Ok(stored)) => (a, stored),
            (answer, fed) => {
                self.drop_generation(generation);
                // The upstream's refusal says most (the body stopped because
                // of it); else the body's own failure (the upload was
                // aborted because of it).
                if let Err(e @ UpstreamError::Status { .. }) = answer {
                    return Err(e.into());
                }
                fed?;
                return Err(answer.err().map_or_else(
                    || CacheError::Failed("the upstream took the write".into()),
                    CacheError::from,
                ));
            }
        };
        let ((etag, version), stored) = stored;
        self.forget(key);
        self.negative.lock().expect("cache negatives").remove(key);
        match self.upstream.head(key).await {
            Ok(Some(meta)) if meta.etag == etag && meta.size == len => {
                let old = self.stored_entry(key).await.ok().flatten();
                let e = Entry {
                    meta,
                    generation: generation.clone(),
                    validated_ns: now_ns(),
                };
                match self.record(key, e, old.as_ref()).await {
                    Ok(e) => self.charge(key, &e, stored),
                    Err(error) => {
                        tracing::warn!(bucket = %self.name, %key, %error, "a written object's entry was not stored; it is fetched when read");
                        self.drop_generation(generation);
                    }
                }
            }
            other => {
                // Another write came between, or the HEAD failed: the
                // object is asked of the upstream when read.
                if let Err(error) = other {
                    tracing::warn!(bucket = %self.name, %key, %error, "no HEAD after a write through");
                }
                if let Ok(Some(old)) = self.stored_entry(key).await {
                    let _ = self.vanish(key, &old).await;
                    self.negative.lock().expect("cache negatives").remove(key);
                }
                self.drop_generation(generation);
            }
        }
        Ok((etag, version))
    }

    /// Feeds `body` to the upload and into chunks of `generation` (if
    /// any); the bytes stored.
    async fn feed(
        &self,
        mut body: ObjectBody,
        tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
        generation: Option<&str>,
    ) -> Result<u64, CacheError> {
        let abort = |tx: &mpsc::Sender<Result<Bytes, std::io::Error>>, why: &str| {
            let _ = tx.try_send(Err(std::io::Error::other(why.to_string())));
        };
        let mut chunk: Vec<Bytes> = Vec::new();
        let mut chunk_len = 0u64;
        let mut n = 0u64;
        let mut held: Option<Bytes> = None;
        let mut stored = 0u64;
        while let Some(piece) = body.stream.next().await {
            let mut piece = match piece {
                Ok(p) => p,
                Err(e) => {
                    abort(&tx, "the client's body failed");
                    return Err(e.into());
                }
            };
            if let Some(h) = held.take() {
                if tx.send(Ok(h)).await.is_err() {
                    return Err(CacheError::Failed(
                        "the upstream stopped taking the body".into(),
                    ));
                }
            }
            held = Some(piece.clone());
            let Some(generation) = generation else {
                continue;
            };
            while !piece.is_empty() {
                let take = ((CHUNK_BYTES - chunk_len) as usize).min(piece.len());
                let part = piece.split_to(take);
                chunk_len += part.len() as u64;
                chunk.push(part);
                if chunk_len == CHUNK_BYTES {
                    stored += self
                        .store_chunk(generation, n, std::mem::take(&mut chunk))
                        .await?;
                    chunk_len = 0;
                    n += 1;
                }
            }
        }
        if let Some(finish) = body.finish.take() {
            if let Err(e) = finish() {
                abort(&tx, "the body failed its checksums");
                return Err(e.into());
            }
        }
        if let (Some(generation), true) = (generation, chunk_len > 0) {
            stored += self.store_chunk(generation, n, chunk).await?;
        }
        if let Some(h) = held {
            if tx.send(Ok(h)).await.is_err() {
                return Err(CacheError::Failed(
                    "the upstream stopped taking the body".into(),
                ));
            }
        }
        Ok(stored)
    }

    async fn store_chunk(
        &self,
        generation: &str,
        n: u64,
        pieces: Vec<Bytes>,
    ) -> Result<u64, CacheError> {
        let len: u64 = pieces.iter().map(|p| p.len() as u64).sum();
        let body = ObjectBody {
            stream: Box::pin(futures::stream::iter(pieces.into_iter().map(Ok))),
            declared_len: Some(len),
            finish: None,
        };
        self.store
            .put_object(
                &self.chunks_bucket,
                &format!("{generation}/{n}"),
                body,
                PutOptions::default(),
            )
            .await?;
        Ok(len)
    }

    /// DELETE through: the upstream first, then the cached object.
    pub async fn delete_through(
        &self,
        key: &str,
        if_match: Option<String>,
    ) -> Result<Option<String>, CacheError> {
        let version = self.upstream.delete(key, if_match).await?;
        self.forget(key);
        if let Some(old) = self.stored_entry(key).await? {
            self.vanish(key, &old).await?;
        } else {
            self.remember_missing(key);
        }
        Ok(version)
    }

    /// UploadPart through: the part's ETag as the upstream answered.
    pub async fn upload_part_through(
        &self,
        key: &str,
        upload_id: &str,
        part_number: i32,
        body: ObjectBody,
        headers: Vec<(String, String)>,
    ) -> Result<String, CacheError> {
        let len = body.declared_len.ok_or_else(|| {
            CacheError::Invalid("a write through a cache needs the body's length".into())
        })?;
        let (tx, rx) = mpsc::channel(UPLOAD_QUEUE);
        let mut h: Vec<(&str, String)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        h.push(("content-length", len.to_string()));
        let n = part_number.to_string();
        let query = [("partNumber", n.as_str()), ("uploadId", upload_id)];
        let upload = self
            .upstream
            .multipart("PUT", key, &query, &h, Upstream::channel_body(rx));
        let (answer, fed) = futures::join!(upload, self.feed(body, tx, None));
        fed?;
        let (headers, _) = answer?;
        headers
            .get("etag")
            .and_then(|v| v.to_str().ok())
            .map(|e| e.trim_matches('"').to_string())
            .ok_or_else(|| {
                CacheError::Failed("the upstream answered a part without an ETag".into())
            })
    }

    /// A multipart request passed through to the upstream.
    pub async fn multipart_through(
        &self,
        method: &str,
        key: &str,
        query: &[(&str, &str)],
        headers: &[(&str, String)],
        body: ReqBody,
    ) -> Result<(http::HeaderMap, String), CacheError> {
        let r = self
            .upstream
            .multipart(method, key, query, headers, body)
            .await?;
        if method == "POST" && query.iter().any(|(k, _)| *k == "uploadId") {
            // Completed: whatever was cached of the key is not the object.
            self.forget(key);
            self.negative.lock().expect("cache negatives").remove(key);
            if let Some(old) = self.stored_entry(key).await? {
                self.vanish(key, &old).await?;
                self.negative.lock().expect("cache negatives").remove(key);
            }
        }
        Ok(r)
    }
}

pub(super) fn random_hex() -> String {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b).expect("the OS random number source");
    b.iter().map(|x| format!("{x:02x}")).collect()
}
