//! GetObjectAttributes: what HEAD says of an object, and its parts, in one
//! XML answer with only the attributes asked for.

use s3s::dto::*;
use s3s::{S3Error, S3ErrorCode, S3Request, S3Response, S3Result};

use crate::access::permit_of;
use crate::ops::{checksum_fields, checksum_type_of, TarnS3};
use crate::util::*;

/// Parts listed in one answer when the request names no `max-parts`.
const PARTS_MAX: usize = 1000;

/// The attributes a request asks for: (etag, checksum, parts, size, class).
fn wanted(list: &ObjectAttributesList) -> S3Result<[bool; 5]> {
    let mut out = [false; 5];
    for a in list {
        // A header may hold several, comma-separated.
        for name in a.as_str().split(',').map(str::trim) {
            let i = match name {
                ObjectAttributes::ETAG => 0,
                ObjectAttributes::CHECKSUM => 1,
                ObjectAttributes::OBJECT_PARTS => 2,
                ObjectAttributes::OBJECT_SIZE => 3,
                ObjectAttributes::STORAGE_CLASS => 4,
                _ => {
                    return Err(S3Error::with_message(
                        S3ErrorCode::InvalidArgument,
                        format!("Invalid attribute name specified: {name}"),
                    ))
                }
            };
            out[i] = true;
        }
    }
    if !out.contains(&true) {
        return Err(S3Error::with_message(
            S3ErrorCode::InvalidArgument,
            "x-amz-object-attributes names no attribute",
        ));
    }
    Ok(out)
}

impl TarnS3 {
    pub(crate) async fn op_get_object_attributes(
        &self,
        req: S3Request<GetObjectAttributesInput>,
    ) -> S3Result<S3Response<GetObjectAttributesOutput>> {
        let i = req.input;
        let [want_etag, want_checksum, want_parts, want_size, want_class] =
            wanted(&i.object_attributes)?;
        let (max, marker) = parts_window(i.max_parts, i.part_number_marker)?;
        let info = self
            .object_info(
                &req.extensions,
                &i.bucket,
                &i.key,
                i.version_id.as_deref(),
                None,
            )
            .await?;
        if let Some(p) = permit_of(&req.extensions) {
            p.allows_object(&info)?;
        }
        // An SSE-C object's attributes need its key, as its HEAD does.
        let customer = crate::sse::customer_key(&req.headers, false)?;
        self.check_customer_key(&req.extensions, &info, customer.as_ref())?;
        let checksum = want_checksum
            .then(|| {
                let [crc32, crc32c, crc64nvme, sha1, sha256] = checksum_fields(&info.checksum);
                info.checksum.as_ref().map(|_| Checksum {
                    checksum_crc32: crc32,
                    checksum_crc32c: crc32c,
                    checksum_crc64nvme: crc64nvme,
                    checksum_sha1: sha1,
                    checksum_sha256: sha256,
                    checksum_type: checksum_type_of(&info.checksum),
                })
            })
            .flatten();
        // A multipart object's parts: the engine keeps each one's size and
        // checksum; of a cache bucket's object only the count its ETag
        // names is known. AWS lists parts only of objects with checksums.
        let total = match info.parts.len() {
            0 => info
                .etag
                .rsplit_once('-')
                .and_then(|(_, n)| n.parse::<i32>().ok()),
            n => Some(n as i32),
        };
        let object_parts = match (want_parts, total) {
            (true, Some(total)) => {
                let after: Vec<_> = info.parts.iter().filter(|p| p.number > marker).collect();
                let truncated = after.len() > max;
                let shown = &after[..after.len().min(max)];
                let listed = info.checksum.is_some() && !info.parts.is_empty();
                Some(GetObjectAttributesParts {
                    total_parts_count: Some(total),
                    part_number_marker: Some(marker as i32),
                    next_part_number_marker: shown.last().map(|p| p.number as i32),
                    max_parts: Some(max as i32),
                    is_truncated: Some(listed && truncated),
                    parts: listed.then(|| {
                        shown
                            .iter()
                            .map(|p| {
                                let [crc32, crc32c, crc64nvme, sha1, sha256] =
                                    checksum_fields(&p.checksum);
                                ObjectPart {
                                    part_number: Some(p.number as i32),
                                    size: Some(p.size as i64),
                                    checksum_crc32: crc32,
                                    checksum_crc32c: crc32c,
                                    checksum_crc64nvme: crc64nvme,
                                    checksum_sha1: sha1,
                                    checksum_sha256: sha256,
                                }
                            })
                            .collect()
                    }),
                })
            }
            _ => None,
        };
        Ok(S3Response::new(GetObjectAttributesOutput {
            e_tag: want_etag.then(|| etag(&info.etag)),
            checksum,
            object_parts,
            object_size: want_size.then_some(info.size as i64),
            storage_class: want_class.then(|| StorageClass::from_static(StorageClass::STANDARD)),
            last_modified: Some(timestamp(info.last_modified_ns)),
            version_id: info.version_id.clone(),
            ..Default::default()
        }))
    }
}

/// `max-parts` and `part-number-marker` as numbers, checked.
fn parts_window(max: Option<i32>, marker: Option<i32>) -> S3Result<(usize, u32)> {
    let max = match max {
        None => PARTS_MAX,
        Some(n) if n < 0 => {
            return Err(S3Error::with_message(
                S3ErrorCode::InvalidArgument,
                "max-parts must be an integer between 0 and 2147483647",
            ))
        }
        Some(n) => (n as usize).min(PARTS_MAX),
    };
    let marker = u32::try_from(marker.unwrap_or(0)).map_err(|_| {
        S3Error::with_message(
            S3ErrorCode::InvalidArgument,
            "part-number-marker must be an integer between 0 and 2147483647",
        )
    })?;
    Ok((max, marker))
}
