//! Checksums computed on buffers in flight.

use crc_fast::CrcAlgorithm;

/// CRC32C (Castagnoli), the bitrot checksum of every shard block and record.
pub fn crc32c(data: &[u8]) -> u32 {
    crc_fast::checksum(CrcAlgorithm::Crc32Iscsi, data) as u32
}

/// CRC32C of the concatenation of `parts`.
pub fn crc32c_parts(parts: &[&[u8]]) -> u32 {
    let mut d = Crc32c::new();
    for p in parts {
        d.update(p);
    }
    d.finish()
}

/// CRC32C of bytes given a slice at a time.
pub struct Crc32c(crc_fast::Digest);

impl Crc32c {
    pub fn new() -> Self {
        Crc32c(crc_fast::Digest::new(CrcAlgorithm::Crc32Iscsi))
    }

    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    pub fn finish(self) -> u32 {
        self.0.finalize() as u32
    }
}

impl Default for Crc32c {
    fn default() -> Self {
        Self::new()
    }
}

/// How a multipart object's checksum is formed from its parts' (S3's
/// `x-amz-checksum-type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChecksumType {
    /// The checksum of the concatenated binary part checksums, then `-N`.
    Composite,
    /// The CRC of the whole object, combined from the parts' CRCs (CRC
    /// algorithms only).
    FullObject,
}

impl ChecksumType {
    pub fn as_str(self) -> &'static str {
        match self {
            ChecksumType::Composite => "COMPOSITE",
            ChecksumType::FullObject => "FULL_OBJECT",
        }
    }

    /// The type of a stored checksum value: a composite one ends in `-N`.
    pub fn of_value(value: &str) -> Self {
        match value.rsplit_once('-') {
            Some((_, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
                ChecksumType::Composite
            }
            _ => ChecksumType::FullObject,
        }
    }

    /// An `x-amz-checksum-type` value (as S3 spells it).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "COMPOSITE" => Some(ChecksumType::Composite),
            "FULL_OBJECT" => Some(ChecksumType::FullObject),
            _ => None,
        }
    }

    /// The type an upload of `algorithm` gets: the one asked for, else the
    /// algorithm's default (AWS: FULL_OBJECT for CRC64NVME, COMPOSITE for
    /// the others); an error when the algorithm cannot have that type.
    pub fn resolve(algorithm: &str, asked: Option<Self>) -> Result<Self, String> {
        let t = asked.unwrap_or(if algorithm == "CRC64NVME" {
            ChecksumType::FullObject
        } else {
            ChecksumType::Composite
        });
        match (algorithm, t) {
            ("CRC32" | "CRC32C" | "SHA1" | "SHA256", ChecksumType::Composite)
            | ("CRC32" | "CRC32C" | "CRC64NVME", ChecksumType::FullObject) => Ok(t),
            _ => Err(format!(
                "The {} checksum type cannot be used with the {algorithm} checksum algorithm.",
                t.as_str()
            )),
        }
    }
}

fn crc_algorithm(algorithm: &str) -> Option<(CrcAlgorithm, usize)> {
    match algorithm {
        "CRC32" => Some((CrcAlgorithm::Crc32IsoHdlc, 4)),
        "CRC32C" => Some((CrcAlgorithm::Crc32Iscsi, 4)),
        "CRC64NVME" => Some((CrcAlgorithm::Crc64Nvme, 8)),
        _ => None,
    }
}

fn digest(algorithm: &str, data: &[u8]) -> Option<Vec<u8>> {
    use sha1::Digest as _;
    if let Some((crc, width)) = crc_algorithm(algorithm) {
        let v = crc_fast::checksum(crc, data);
        return Some(v.to_be_bytes()[8 - width..].to_vec());
    }
    match algorithm {
        "SHA1" => Some(sha1::Sha1::digest(data).to_vec()),
        "SHA256" => Some(sha2::Sha256::digest(data).to_vec()),
        _ => None,
    }
}

/// A multipart object's checksum from its parts' (base64 values and sizes,
/// in order), as S3 forms it; None when a part value does not decode or the
/// algorithm cannot have the type.
pub fn multipart_checksum(
    algorithm: &str,
    kind: ChecksumType,
    parts: &[(&str, u64)],
) -> Option<String> {
    let b64 = base64_simd::STANDARD;
    let raw: Vec<Vec<u8>> = parts
        .iter()
        .map(|(v, _)| b64.decode_to_vec(v).ok())
        .collect::<Option<_>>()?;
    match kind {
        ChecksumType::Composite => {
            let concat: Vec<u8> = raw.concat();
            let d = digest(algorithm, &concat)?;
            Some(format!("{}-{}", b64.encode_to_string(&d), parts.len()))
        }
        ChecksumType::FullObject => {
            let (crc, width) = crc_algorithm(algorithm)?;
            let mut acc: Option<u64> = None;
            for (bytes, (_, len)) in raw.iter().zip(parts) {
                if bytes.len() != width {
                    return None;
                }
                let mut be = [0u8; 8];
                be[8 - width..].copy_from_slice(bytes);
                let v = u64::from_be_bytes(be);
                acc = Some(match acc {
                    None => v,
                    Some(a) => crc_fast::checksum_combine(crc, a, v, *len),
                });
            }
            let v = acc?;
            Some(b64.encode_to_string(&v.to_be_bytes()[8 - width..]))
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn crc32c_known_vector() {
        // RFC 3720 test vector: 32 bytes of zeros.
        assert_eq!(super::crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(super::crc32c(b"123456789"), 0xe306_9283);
    }

    fn b64(algorithm: &str, data: &[u8]) -> String {
        base64_simd::STANDARD.encode_to_string(super::digest(algorithm, data).unwrap())
    }

    #[test]
    fn multipart_checksums() {
        use super::{multipart_checksum, ChecksumType::*};
        let (a, b) = (&b"hello "[..], &b"multipart world"[..]);
        for algo in ["CRC32", "CRC32C", "CRC64NVME"] {
            // A full-object CRC combined from the parts is the CRC of the whole.
            let parts = [(b64(algo, a).as_str(), 6), (b64(algo, b).as_str(), 15)]
                .map(|(v, l)| (v.to_string(), l));
            let refs: Vec<(&str, u64)> = parts.iter().map(|(v, l)| (v.as_str(), *l)).collect();
            let whole = [a, b].concat();
            assert_eq!(
                multipart_checksum(algo, FullObject, &refs).unwrap(),
                b64(algo, &whole),
                "{algo}"
            );
        }
        // Composite: the checksum of the concatenated raw part checksums, -N.
        let pa = super::digest("SHA256", a).unwrap();
        let pb = super::digest("SHA256", b).unwrap();
        let want = format!(
            "{}-2",
            base64_simd::STANDARD
                .encode_to_string(super::digest("SHA256", &[pa, pb].concat()).unwrap())
        );
        let (va, vb) = (b64("SHA256", a), b64("SHA256", b));
        assert_eq!(
            multipart_checksum("SHA256", Composite, &[(&va, 6), (&vb, 15)]).unwrap(),
            want
        );
        assert_eq!(super::ChecksumType::of_value(&want), Composite);
        assert_eq!(super::ChecksumType::of_value(&va), FullObject);
        assert!(multipart_checksum("SHA256", FullObject, &[(&va, 6)]).is_none());
        assert!(multipart_checksum("CRC32", Composite, &[("!!", 6)]).is_none());
        assert!(super::ChecksumType::resolve("SHA1", Some(FullObject)).is_err());
        assert!(super::ChecksumType::resolve("CRC64NVME", Some(Composite)).is_err());
        assert_eq!(super::ChecksumType::parse("FULL_OBJECT"), Some(FullObject));
        assert_eq!(super::ChecksumType::parse(""), None);
        assert_eq!(
            super::ChecksumType::resolve("CRC64NVME", None),
            Ok(FullObject)
        );
        assert_eq!(super::ChecksumType::resolve("CRC32", None), Ok(Composite));
    }
}
