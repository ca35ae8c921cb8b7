//! Multipart uploads. Each part is erasure-coded into its own shard files when
//! it arrives; completion commits one version whose part table points at them,
//! so no bytes are copied. Aborting touches only the upload, never the live
//! object of the same key.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::drive_io::Drive;
use md5::{Digest, Md5};

use super::commit::NewVersion;
use super::put::{single_etag, BodyReader};
use super::{now_ns, validate_key, Store};
use crate::checksum::{multipart_checksum, ChecksumType};
use crate::error::StoreError;
use crate::format::{
    id_from_hex, id_to_hex, new_id, Id128, PartMeta, Storage, UploadPartRecord, UploadRecord,
    VersionMeta, Versioning,
};
use crate::types::{ObjectBody, ObjectInfo, PartInfo, PutOptions, UploadInfo};

/// Upper bound on one part (S3: 5 GiB).
pub const PART_SIZE_MAX_BYTES: u64 = 5 << 30;

fn parse_upload_id(s: &str) -> Result<Id128, StoreError> {
    id_from_hex(s).ok_or_else(|| StoreError::NoSuchUpload(s.to_string()))
}

impl Store {
    pub async fn create_multipart_upload(
        &self,
        bucket: &str,
        key: &str,
        opts: PutOptions,
        checksum_algorithm: Option<String>,
    ) -> Result<String, StoreError> {
        let brec = self.bucket_record(bucket)?;
        validate_key(key)?;
        super::check_lock_allowed(&brec, &opts.lock)?;
        let (set, layout) = self.layout_for(&brec, bucket, key).await?;
        let mut headers = opts.headers;
        headers.retain(|(k, _)| k != crate::format::UPLOAD_LOCK_HEADER);
        if let Some(lock) = opts.lock.filter(|l| !l.is_empty()) {
            headers.push((crate::format::UPLOAD_LOCK_HEADER.into(), lock.to_header()));
        }
        let rec = UploadRecord {
            upload_id: new_id(),
            initiated_ns: now_ns(),
            content_type: opts
                .content_type
                .unwrap_or_else(|| "binary/octet-stream".into()),
            headers,
            user_metadata: opts.user_metadata,
            tags: opts.tags,
            checksum_type: match (&checksum_algorithm, opts.checksum_type) {
                (Some(_), Some(t)) => t.as_str().to_string(),
                _ => String::new(),
            },
            checksum_algorithm: checksum_algorithm.unwrap_or_default(),
            layout,
        };
        let targets = self.writers((0..self.set_size(set)).map(|p| self.slot(set, p)));
        let futs = targets
            .iter()
            .map(|(_, d)| d.put_upload(bucket.to_string(), key.to_string(), rec.clone()));
        let results = futures::future::join_all(futs).await;
        let ok = self.count_index_writes("metadata write", &targets, &results);
        let quorum = self.meta_write_quorum(self.set_size(set));
        if ok < quorum {
            return Err(StoreError::QuorumLost {
                what: "upload create",
                needed: quorum,
                available: ok,
            });
        }
        Ok(id_to_hex(&rec.upload_id))
    }

    /// The set an upload in progress was created in (one of the key's sets,
    /// one per pool) and its record.
    async fn upload_located(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &Id128,
    ) -> Result<(usize, UploadRecord), StoreError> {
        for set in self.key_sets(bucket, key) {
            match self.upload(set, bucket, key, upload_id).await {
                Err(StoreError::NoSuchUpload(_)) => continue,
                r => return r.map(|u| (set, u)),
            }
        }
        Err(StoreError::NoSuchUpload(id_to_hex(upload_id)))
    }

    /// The upload record, from any drive of the set that has it.
    async fn upload(
        &self,
        set: usize,
        bucket: &str,
        key: &str,
        upload_id: &Id128,
    ) -> Result<UploadRecord, StoreError> {
        let futs = (0..self.set_size(set))
            .filter_map(|p| self.slot(set, p).db())
            .map(|d| async move {
                d.upload(bucket.to_string(), key.to_string(), *upload_id)
                    .await
            });
        let mut found = 0;
        let mut rec = None;
        for r in futures::future::join_all(futs).await {
            if let Ok(Some(u)) = r {
                found += 1;
                rec = Some(u);
            }
        }
        let quorum = self.meta_read_quorum(self.set_size(set));
        match rec {
            Some(r) if found >= quorum => Ok(r),
            _ => Err(StoreError::NoSuchUpload(id_to_hex(upload_id))),
        }
    }

    /// Copies the multipart uploads in progress of `bucket` in `set` (their
    /// records and parts, as a read quorum of the other drives has them) onto
    /// `targets`, drives whose index is being rebuilt. Returns how many.
    pub(crate) async fn heal_uploads(
        &self,
        set: usize,
        bucket: &str,
        targets: &[(Arc<super::DriveSlot>, Arc<dyn Drive>)],
    ) -> Result<u64, StoreError> {
        let sources: Vec<_> = (0..self.set_size(set))
            .filter_map(|p| self.slot(set, p).db())
            .collect();
        let found = bucket_uploads(sources, bucket).await?;
        let mut copied = 0;
        for (key, id) in found {
            if !self.key_sets(bucket, &key).contains(&set) {
                continue;
            }
            // Not while it completes or aborts.
            let _g = self.lock_write(bucket, &key).await?;
            let rec = match self.upload(set, bucket, &key, &id).await {
                Ok(r) => r,
                Err(StoreError::NoSuchUpload(_)) => continue,
                Err(e) => return Err(e),
            };
            let parts: Vec<UploadPartRecord> =
                self.upload_parts(set, &id).await?.into_values().collect();
            let futs = targets.iter().map(|(_, d)| {
                let (rec, parts, key) = (rec.clone(), parts.clone(), key.clone());
                async move {
                    d.put_upload(bucket.to_string(), key, rec).await?;
                    for p in parts {
                        d.put_part(id, p).await?;
                    }
                    Ok(())
                }
            });
            let results = futures::future::join_all(futs).await;
            if self.count_index_writes("upload heal", targets, &results) < targets.len() {
                return Err(StoreError::from(std::io::Error::other(
                    "copying an upload to a rebuilding drive failed",
                )));
            }
            copied += 1;
        }
        Ok(copied)
    }

    /// The parts a read quorum agrees on, newest record per part number.
    async fn upload_parts(
        &self,
        set: usize,
        upload_id: &Id128,
    ) -> Result<BTreeMap<u32, UploadPartRecord>, StoreError> {
        let futs = (0..self.set_size(set))
            .filter_map(|p| self.slot(set, p).db())
            .map(|d| async move { d.parts(*upload_id).await });
        let mut counts: Vec<(UploadPartRecord, usize)> = Vec::new();
        for parts in futures::future::join_all(futs).await.into_iter().flatten() {
            for p in parts {
                match counts
                    .iter_mut()
                    .find(|(x, _)| x.number == p.number && x.data_id == p.data_id)
                {
                    Some(e) => e.1 += 1,
                    None => counts.push((p, 1)),
                }
            }
        }
        let quorum = self.meta_read_quorum(self.set_size(set));
        let mut out: BTreeMap<u32, UploadPartRecord> = BTreeMap::new();
        for (p, c) in counts {
            if c < quorum {
                continue;
            }
            match out.get(&p.number) {
                Some(existing) if existing.mod_time_ns >= p.mod_time_ns => {}
                _ => {
                    out.insert(p.number, p);
                }
            }
        }
        Ok(out)
    }

    /// The checksum algorithm an upload in progress was created with, which
    /// every part must carry.
    pub async fn upload_checksum_algorithm(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
    ) -> Result<Option<String>, StoreError> {
        self.bucket_record(bucket)?;
        let id = parse_upload_id(upload_id)?;
        let (_, u) = self.upload_located(bucket, key, &id).await?;
        Ok((!u.checksum_algorithm.is_empty()).then_some(u.checksum_algorithm))
    }

    /// The stored headers of an upload in progress (its encryption, ACL…).
    pub async fn upload_headers(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
    ) -> Result<Vec<(String, String)>, StoreError> {
        self.bucket_record(bucket)?;
        let id = parse_upload_id(upload_id)?;
        let (_, u) = self.upload_located(bucket, key, &id).await?;
        Ok(u.headers)
    }

    #[allow(clippy::too_many_arguments)]
    pub async fn upload_part(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        number: u32,
        body: ObjectBody,
        content_md5: Option<[u8; 16]>,
        checksum: Option<(String, String)>,
    ) -> Result<PartInfo, StoreError> {
        self.upload_part_sealed(
            bucket,
            key,
            upload_id,
            number,
            body,
            content_md5,
            checksum,
            None,
        )
        .await
    }

    /// UploadPart, encrypted with `seal` when given. The parts of one upload
    /// are all encrypted or none (CompleteMultipartUpload checks).
    #[allow(clippy::too_many_arguments)]
    pub async fn upload_part_sealed(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        number: u32,
        body: ObjectBody,
        content_md5: Option<[u8; 16]>,
        checksum: Option<(String, String)>,
        seal: Option<crate::seal::SealSpec>,
    ) -> Result<PartInfo, StoreError> {
        self.bucket_record(bucket)?;
        validate_key(key)?;
        if number == 0 || number > self.cfg.part_count_max {
            return Err(StoreError::InvalidArgument(format!(
                "part number must be between 1 and {}",
                self.cfg.part_count_max
            )));
        }
        if let Some(len) = body.declared_len {
            if len > PART_SIZE_MAX_BYTES {
                return Err(StoreError::EntityTooLarge {
                    size: len,
                    max: PART_SIZE_MAX_BYTES,
                });
            }
        }
        let id = parse_upload_id(upload_id)?;
        let (set, upload) = self.upload_located(bucket, key, &id).await?;
        let use_md5 = self.wants_md5(content_md5.is_some(), body.declared_len);
        let mut reader = BodyReader::new(body, use_md5, PART_SIZE_MAX_BYTES);
        let salt = seal.as_ref().map(|spec| {
            let salt = crate::seal::new_salt();
            reader.seal(spec, &salt, number);
            salt
        });
        let written = self.write_data(set, &upload.layout, &mut reader).await?;
        let reader_total = reader.total;
        let result = async {
            let digest = reader.finish(content_md5)?;
            let checksum = digest.checksum.clone().or(checksum);
            let algo = &upload.checksum_algorithm;
            if !algo.is_empty() && checksum.as_ref().is_none_or(|(a, _)| a != algo) {
                return Err(StoreError::InvalidRequest(format!(
                    "The upload was created using the {algo} checksum algorithm; each part must carry its x-amz-checksum-{} (checksum type mismatch: expected {algo}, got {}).",
                    algo.to_ascii_lowercase(),
                    checksum.as_ref().map_or("none", |(a, _)| a.as_str()),
                )));
            }
            let etag = match &seal {
                Some(spec) => spec.etag(single_etag(&digest)),
                None => single_etag(&digest),
            };
            let rec = UploadPartRecord {
                number,
                size: written.size,
                etag,
                data_id: written.data_id,
                mod_time_ns: now_ns(),
                checksum,
                salt,
            };
            let _g = self
                .locks
                .write(bucket, &format!("\0upload\0{upload_id}\0{number}"))
                .await;
            // The upload may have been completed or aborted meanwhile.
            self.upload(set, bucket, key, &id).await?;
            let previous = self.upload_parts(set, &id).await?.remove(&number);
            let targets = self.writers((0..self.set_size(set)).map(|p| self.slot(set, p)));
            let futs = targets.iter().map(|(_, d)| d.put_part(id, rec.clone()));
            let results = futures::future::join_all(futs).await;
            let ok = self.count_index_writes("metadata write", &targets, &results);
            let quorum = self.meta_write_quorum(self.set_size(set));
            if ok < quorum {
                return Err(StoreError::QuorumLost {
                    what: "part commit",
                    needed: quorum,
                    available: ok,
                });
            }
            if let Some(prev) = previous {
                self.remove_data(set, vec![prev.data_id]).await;
            }
            Ok(PartInfo {
                number,
                size: reader_total,
                etag: rec.etag.clone(),
                last_modified_ns: rec.mod_time_ns,
                checksum: rec.checksum.clone(),
            })
        }
        .await;
        if result.is_err() {
            self.remove_data(set, vec![written.data_id]).await;
        }
        result
    }

    pub async fn list_parts(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        after: u32,
        max: usize,
    ) -> Result<(Vec<PartInfo>, bool, UploadInfo), StoreError> {
        self.bucket_record(bucket)?;
        let id = parse_upload_id(upload_id)?;
        let (set, upload) = self.upload_located(bucket, key, &id).await?;
        let parts = self.upload_parts(set, &id).await?;
        let mut out: Vec<PartInfo> = parts
            .into_values()
            .filter(|p| p.number > after)
            .map(|p| PartInfo {
                number: p.number,
                size: part_plain_size(&p),
                etag: p.etag,
                last_modified_ns: p.mod_time_ns,
                checksum: p.checksum,
            })
            .collect();
        let truncated = out.len() > max;
        out.truncate(max);
        Ok((
            out,
            truncated,
            UploadInfo {
                bucket: bucket.into(),
                key: key.into(),
                upload_id: upload_id.into(),
                initiated_ns: upload.initiated_ns,
                headers: upload.headers,
            },
        ))
    }

    pub async fn abort_multipart_upload(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
    ) -> Result<(), StoreError> {
        self.bucket_record(bucket)?;
        let id = parse_upload_id(upload_id)?;
        let _g = self.lock_write(bucket, key).await?;
        let (set, _) = self.upload_located(bucket, key, &id).await?;
        let parts = self.upload_parts(set, &id).await?;
        self.remove_upload(set, (bucket, key), id, &parts).await
    }

    /// Removes an upload from its set: its record, its parts' records and
    /// their data.
    async fn remove_upload(
        &self,
        set: usize,
        (bucket, key): (&str, &str),
        id: Id128,
        parts: &BTreeMap<u32, UploadPartRecord>,
    ) -> Result<(), StoreError> {
        let numbers: Vec<u32> = parts.keys().copied().collect();
        let targets = self.writers((0..self.set_size(set)).map(|p| self.slot(set, p)));
        let futs = targets.iter().map(|(_, d)| {
            d.delete_upload(bucket.to_string(), key.to_string(), id, numbers.clone())
        });
        let results = futures::future::join_all(futs).await;
        let ok = self.count_index_writes("metadata write", &targets, &results);
        let quorum = self.meta_write_quorum(self.set_size(set));
        if ok < quorum {
            return Err(StoreError::QuorumLost {
                what: "upload removal",
                needed: quorum,
                available: ok,
            });
        }
        self.remove_data(set, parts.values().map(|p| p.data_id).collect())
            .await;
        Ok(())
    }

    /// Completes an upload whose key came to live in another set than its
    /// parts while it ran (moved out of a draining pool, or made in another
    /// pool by a racing write), where a commit beside the parts would split
    /// the key's versions between pools: the chosen parts' data is copied
    /// into the key's set and the version committed there, then the upload
    /// is removed from its own set. None when the key lives with the parts
    /// (the commit's SlowDown had another cause).
    async fn complete_where_the_key_lives(
        self: &Arc<Self>,
        from: usize,
        (bucket, key): (&str, &str),
        (id, parts): (Id128, &BTreeMap<u32, UploadPartRecord>),
        meta: &VersionMeta,
        opts: &PutOptions,
    ) -> Result<Option<ObjectInfo>, StoreError> {
        let to = self.locate(bucket, key).await?.set;
        if to == from {
            return Ok(None);
        }
        let mut written = Vec::new();
        let committed = async {
            let (copy, _) = self
                .copy_version(meta, (from, to), (bucket, key), &mut written)
                .await?;
            self.commit_version(bucket, key, NewVersion::new(to, copy, None, opts))
                .await
        }
        .await;
        let info = match committed {
            Ok(info) => info,
            Err(e) => {
                self.remove_data(to, written.iter().map(|w| w.data_id).collect())
                    .await;
                return Err(e);
            }
        };
        drop(written);
        tracing::info!(%bucket, %key, from, to, "an upload completed where its key lives now: its parts were copied there");
        if let Err(error) = self.remove_upload(from, (bucket, key), id, parts).await {
            // Committed all the same; the upload is left to be aborted.
            tracing::warn!(%bucket, %key, %error, "removing a completed upload from its old set failed");
        }
        Ok(Some(info))
    }

    /// Completes an upload with the client's part list: the commit point of the
    /// object. Parts not listed are deleted.
    pub async fn complete_multipart_upload(
        self: &Arc<Self>,
        bucket: &str,
        key: &str,
        upload_id: &str,
        list: &[(u32, String)],
        opts: &PutOptions,
    ) -> Result<ObjectInfo, StoreError> {
        let brec = self.bucket_record(bucket)?;
        let id = parse_upload_id(upload_id)?;
        if list.is_empty() {
            return Err(StoreError::InvalidArgument("the part list is empty".into()));
        }
        if list.windows(2).any(|w| w[0].0 >= w[1].0) {
            return Err(StoreError::InvalidPartOrder);
        }
        let (set, upload) = match self.upload_located(bucket, key, &id).await {
            Ok(u) => u,
            Err(StoreError::NoSuchUpload(u)) => {
                // A retry of a completion that already succeeded (its response
                // was lost): the request's part ETags determine the multipart
                // ETag, so if the key's current version carries it, answer
                // success instead of a false failure.
                if let Some(etag) = multipart_etag(list) {
                    if let Ok(info) = self.head_object(bucket, key, None).await {
                        if info.etag == etag {
                            return Ok(info);
                        }
                    }
                }
                return Err(StoreError::NoSuchUpload(u));
            }
            Err(e) => return Err(e),
        };
        let parts = self.upload_parts(set, &id).await?;
        let mut chosen = Vec::with_capacity(list.len());
        let mut md5_concat = Md5::new();
        let mut plain_size = 0u64;
        let mut salts = Vec::new();
        for (i, (number, etag)) in list.iter().enumerate() {
            let p = parts.get(number).ok_or(StoreError::InvalidPart(*number))?;
            if etag.trim_matches('"') != p.etag {
                return Err(StoreError::InvalidPart(*number));
            }
            let listed = opts.part_checksums.iter().filter(|c| c.0 == *number);
            for (_, algo, value) in listed {
                if !p
                    .checksum
                    .as_ref()
                    .is_some_and(|(a, v)| a == algo && v == value)
                {
                    return Err(StoreError::InvalidPart(*number));
                }
            }
            let plain = part_plain_size(p);
            if i + 1 < list.len() && plain < self.cfg.part_size_min_bytes {
                return Err(StoreError::EntityTooSmall {
                    number: *number,
                    size: plain,
                    min: self.cfg.part_size_min_bytes,
                });
            }
            if p.salt.is_some() != list_sealed(&parts, list) {
                return Err(StoreError::InvalidRequest(format!(
                    "Part {number} was uploaded {} encryption, unlike the upload's other parts.",
                    if p.salt.is_some() { "with" } else { "without" }
                )));
            }
            plain_size += plain;
            salts.extend(p.salt);
            let raw = part_digest(&p.etag).ok_or(StoreError::InvalidPart(*number))?;
            md5_concat.update(raw);
            chosen.push(PartMeta {
                number: *number,
                size: p.size,
                etag: p.etag.clone(),
                data_id: p.data_id,
                checksum: p.checksum.clone(),
            });
        }
        let checksum = object_checksum(&upload, &chosen, opts)?;
        let etag = format!("{}-{}", super::put::hex(&md5_concat.finalize()), list.len());
        let size = plain_size;
        let seal = (!salts.is_empty()).then_some(crate::format::Seal {
            cipher: crate::seal::CIPHER_AES256_GCM_64K,
            salts,
        });
        let unused: Vec<Id128> = parts
            .values()
            .filter(|p| !chosen.iter().any(|c| c.data_id == p.data_id))
            .map(|p| p.data_id)
            .collect();
        // The lock asked for when the upload was created.
        let mut headers = upload.headers.clone();
        let lock = headers
            .iter()
            .find(|(k, _)| k == crate::format::UPLOAD_LOCK_HEADER)
            .and_then(|(_, v)| crate::format::ObjectLock::from_header(v));
        headers.retain(|(k, _)| k != crate::format::UPLOAD_LOCK_HEADER);
        super::check_lock_allowed(&brec, &lock)?;
        let meta = VersionMeta {
            version_id: if brec.versioning == Versioning::Enabled {
                new_id()
            } else {
                super::NULL_VERSION
            },
            mod_time_ns: 0,
            delete_marker: false,
            size,
            etag,
            content_type: upload.content_type.clone(),
            headers,
            user_metadata: upload.user_metadata.clone(),
            tags: upload.tags.clone(),
            checksum,
            layout: upload.layout.clone(),
            storage: Storage::Parts(chosen),
            seal,
            lock,
        };
        let numbers: Vec<u32> = parts.keys().copied().collect();
        let info = match self
            .commit_version(bucket, key, {
                let mut v = NewVersion::new(set, meta.clone(), None, opts);
                v.upload_delete = Some((id, numbers));
                v
            })
            .await
        {
            Err(StoreError::SlowDown(why)) => {
                return match self
                    .complete_where_the_key_lives(set, (bucket, key), (id, &parts), &meta, opts)
                    .await?
                {
                    Some(info) => Ok(info),
                    None => Err(StoreError::SlowDown(why)),
                };
            }
            r => r?,
        };
        self.remove_data(set, unused).await;
        Ok(info)
    }

    /// Uploads in progress in `bucket` under `prefix`, ordered by key then
    /// start; with a delimiter, keys roll up into common prefixes as in listings.
    #[allow(clippy::too_many_arguments)]
    pub async fn list_multipart_uploads(
        self: &Arc<Self>,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        key_marker: Option<&str>,
        upload_id_marker: Option<&str>,
        max: usize,
    ) -> Result<(Vec<UploadInfo>, Vec<String>, bool), StoreError> {
        self.bucket_record(bucket)?;
        let drives: Vec<_> = self.topo().slots.iter().filter_map(|d| d.db()).collect();
        let mut seen: BTreeMap<(String, u64, String), Vec<(String, String)>> = BTreeMap::new();
        for d in drives {
            for (key, rec) in d
                .scan_uploads(bucket.to_string(), prefix.to_string(), 100_000)
                .await?
            {
                seen.insert(
                    (key, rec.initiated_ns, id_to_hex(&rec.upload_id)),
                    rec.headers,
                );
            }
        }
        let mut out: Vec<UploadInfo> = Vec::new();
        let mut prefixes: Vec<String> = Vec::new();
        let mut truncated = false;
        for ((key, initiated_ns, id), headers) in seen {
            if let Some(km) = key_marker {
                let after_marker = match upload_id_marker {
                    Some(um) if key == km => id.as_str() > um,
                    _ => key.as_str() > km,
                };
                if !after_marker {
                    continue;
                }
            }
            let cp = delimiter.filter(|d| !d.is_empty()).and_then(|d| {
                key[prefix.len()..].find(d).map(|pos| {
                    format!(
                        "{prefix}{}",
                        &key[prefix.len()..prefix.len() + pos + d.len()]
                    )
                })
            });
            if let Some(cp) = &cp {
                if prefixes.last() == Some(cp) {
                    continue;
                }
            }
            if out.len() + prefixes.len() >= max {
                truncated = true;
                break;
            }
            match cp {
                Some(cp) => prefixes.push(cp),
                None => out.push(UploadInfo {
                    bucket: bucket.into(),
                    key,
                    upload_id: id,
                    initiated_ns,
                    headers,
                }),
            }
        }
        Ok((out, prefixes, truncated))
    }
}

/// The checksum a completed upload stores: formed from its parts' as the
/// upload's checksum type says, and checked against what the client declared
/// on the completion (its type, and the whole object's value). An upload
/// created without an algorithm gets one only when every part carries the
/// same algorithm and the client asks for it; a checksum that cannot be
/// formed is refused, never stored unverified.
fn object_checksum(
    upload: &UploadRecord,
    chosen: &[PartMeta],
    opts: &PutOptions,
) -> Result<Option<(String, String)>, StoreError> {
    let (algo, kind) = if upload.checksum_algorithm.is_empty() {
        let Some((algo, _)) = &opts.checksum else {
            if let Some(t) = opts.checksum_type {
                return Err(StoreError::InvalidRequest(format!(
                    "The upload was created without a checksum algorithm; the {} checksum type does not apply.",
                    t.as_str()
                )));
            }
            return Ok(None);
        };
        let kind =
            ChecksumType::resolve(algo, opts.checksum_type).map_err(StoreError::InvalidRequest)?;
        (algo.clone(), kind)
    } else {
        let algo = upload.checksum_algorithm.clone();
        // Empty in uploads of format 1: the algorithm's default.
        let kind = ChecksumType::resolve(&algo, ChecksumType::parse(&upload.checksum_type))
            .map_err(StoreError::InvalidRequest)?;
        if let Some(t) = opts.checksum_type.filter(|t| *t != kind) {
            return Err(StoreError::InvalidRequest(format!(
                "The upload was created using the {} checksum type; the completion asked for {}.",
                kind.as_str(),
                t.as_str()
            )));
        }
        (algo, kind)
    };
    let mut values = Vec::with_capacity(chosen.len());
    for p in chosen {
        match &p.checksum {
            Some((a, v)) if *a == algo => values.push((v.as_str(), p.size)),
            _ => {
                return Err(StoreError::InvalidRequest(format!(
                    "Part {} was uploaded without an {algo} checksum; the object's {algo} checksum cannot be formed.",
                    p.number
                )))
            }
        }
    }
    let value = multipart_checksum(&algo, kind, &values).ok_or_else(|| {
        StoreError::InvalidRequest(format!(
            "The {algo} checksums of the parts cannot form a {} checksum.",
            kind.as_str()
        ))
    })?;
    if let Some((a, want)) = &opts.checksum {
        let bare = |v: &str| -> String {
            match ChecksumType::of_value(v) {
                ChecksumType::Composite => v.rsplit_once('-').map_or(v, |(b, _)| b).to_string(),
                ChecksumType::FullObject => v.to_string(),
            }
        };
        if *a != algo {
            return Err(StoreError::InvalidRequest(format!(
                "The upload uses the {algo} checksum algorithm; the completion declared {a}."
            )));
        }
        if bare(want) != bare(&value) {
            return Err(StoreError::ChecksumMismatch { algorithm: algo });
        }
    }
    Ok(Some((algo, value)))
}

/// The multipart uploads in progress of `bucket` on `dbs` (keys and upload
/// ids, each once).
pub(crate) async fn bucket_uploads(
    drives: Vec<Arc<dyn Drive>>,
    bucket: &str,
) -> Result<std::collections::BTreeSet<(String, Id128)>, StoreError> {
    let mut all = std::collections::BTreeSet::new();
    for d in drives {
        for (key, rec) in d
            .scan_uploads(bucket.to_string(), String::new(), usize::MAX)
            .await?
        {
            all.insert((key, rec.upload_id));
        }
    }
    Ok(all)
}

/// S3's multipart ETag for a part list: MD5 of the concatenated binary part
/// digests, then `-N`.
fn multipart_etag(list: &[(u32, String)]) -> Option<String> {
    let mut md5 = Md5::new();
    for (_, etag) in list {
        md5.update(part_digest(etag)?);
    }
    Some(format!(
        "{}-{}",
        super::put::hex(&md5.finalize()),
        list.len()
    ))
}

/// The 16 bytes behind a part ETag: its MD5, or the fast digest of a part
/// ETag marked `-1` (quotes allowed).
fn part_digest(etag: &str) -> Option<[u8; 16]> {
    let e = etag.trim_matches('"');
    id_from_hex(e.strip_suffix("-1").unwrap_or(e))
}

/// A part's plaintext size (an encrypted part's record holds its sealed length).
fn part_plain_size(p: &UploadPartRecord) -> u64 {
    match p.salt {
        Some(_) => crate::seal::plain_len(p.size).unwrap_or(0),
        None => p.size,
    }
}

/// Whether the first part a completion lists is encrypted (every other
/// part must be alike).
fn list_sealed(
    parts: &std::collections::BTreeMap<u32, UploadPartRecord>,
    list: &[(u32, String)],
) -> bool {
    list.first()
        .and_then(|(n, _)| parts.get(n))
        .is_some_and(|p| p.salt.is_some())
}
