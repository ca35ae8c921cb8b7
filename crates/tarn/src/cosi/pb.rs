//! The protobuf encoding of the COSI messages `tarn cosi` reads and writes
//! (proto3, `sigs.k8s.io.cosi.v1alpha2`; field numbers in `cosi.proto`
//! next to this file). Written by hand: a dozen small messages do not pay
//! for a code generator in the build.
//!
//! Decoding keeps what Tarn uses and skips any other field, as proto3
//! readers do; a truncated or malformed message is an error.

use std::collections::BTreeMap;

#[derive(Debug, PartialEq, Eq)]
pub struct DecodeError(pub &'static str);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "malformed protobuf message: {}", self.0)
    }
}

/// One field of a message as read from the wire.
enum Value<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    /// Fixed 32- and 64-bit values: no COSI field has them; skipped.
    Fixed,
}

fn varint(b: &mut &[u8]) -> Result<u64, DecodeError> {
    let mut v = 0u64;
    for i in 0..10 {
        let (&byte, rest) = b.split_first().ok_or(DecodeError("truncated varint"))?;
        *b = rest;
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(DecodeError("varint longer than 10 bytes"))
}

/// The fields of a message, in wire order.
fn fields(mut b: &[u8]) -> Result<Vec<(u32, Value<'_>)>, DecodeError> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let key = varint(&mut b)?;
        let number = u32::try_from(key >> 3).map_err(|_| DecodeError("field number"))?;
        if number == 0 {
            return Err(DecodeError("field number 0"));
        }
        let value = match key & 7 {
            0 => Value::Varint(varint(&mut b)?),
            1 | 5 => {
                let n = if key & 7 == 1 { 8 } else { 4 };
                if b.len() < n {
                    return Err(DecodeError("truncated fixed-width field"));
                }
                b = &b[n..];
                Value::Fixed
            }
            2 => {
                let n = usize::try_from(varint(&mut b)?).map_err(|_| DecodeError("length"))?;
                if b.len() < n {
                    return Err(DecodeError("truncated length-delimited field"));
                }
                let (v, rest) = b.split_at(n);
                b = rest;
                Value::Bytes(v)
            }
            _ => return Err(DecodeError("unsupported wire type (groups)")),
        };
        out.push((number, value));
    }
    Ok(out)
}

fn string(v: &Value<'_>) -> Result<String, DecodeError> {
    match v {
        Value::Bytes(b) => {
            String::from_utf8(b.to_vec()).map_err(|_| DecodeError("string not UTF-8"))
        }
        _ => Err(DecodeError("a string field of another wire type")),
    }
}

fn message<'a>(v: &Value<'a>) -> Result<&'a [u8], DecodeError> {
    match v {
        Value::Bytes(b) => Ok(b),
        _ => Err(DecodeError("a message field of another wire type")),
    }
}

fn enum_value(v: &Value<'_>) -> Result<i32, DecodeError> {
    match v {
        // Enums are int32 on the wire (negative ones sign-extended to 64 bits).
        Value::Varint(n) => Ok(*n as i64 as i32),
        _ => Err(DecodeError("an enum field of another wire type")),
    }
}

/// A message whose only field is an enum at number 1 (`ObjectProtocol`,
/// `AuthenticationType`, `AccessMode`): that enum's value.
fn enum_message(b: &[u8]) -> Result<i32, DecodeError> {
    let mut out = 0;
    for (n, v) in fields(b)? {
        if n == 1 {
            out = enum_value(&v)?;
        }
    }
    Ok(out)
}

/// A `map<string, string>` entry.
fn map_entry(b: &[u8], map: &mut BTreeMap<String, String>) -> Result<(), DecodeError> {
    let (mut k, mut val) = (String::new(), String::new());
    for (n, v) in fields(b)? {
        match n {
            1 => k = string(&v)?,
            2 => val = string(&v)?,
            _ => {}
        }
    }
    map.insert(k, val);
    Ok(())
}

// ObjectProtocol.Type
pub const PROTOCOL_S3: i32 = 1;
// AuthenticationType.Type
pub const AUTH_KEY: i32 = 1;
pub const AUTH_SERVICE_ACCOUNT: i32 = 2;
// AccessMode.Mode
pub const MODE_READ_WRITE: i32 = 1;
pub const MODE_READ_ONLY: i32 = 2;
pub const MODE_WRITE_ONLY: i32 = 3;
// S3AddressingStyle.Style
const STYLE_PATH: i32 = 1;

/// `DriverCreateBucketRequest` and `DriverGetExistingBucketRequest` (whose
/// `existing_bucket_id` is field 1 too).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct BucketRequest {
    pub name: String,
    pub protocols: Vec<i32>,
    pub parameters: BTreeMap<String, String>,
}

impl BucketRequest {
    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Self::default();
        for (n, v) in fields(b)? {
            match n {
                1 => r.name = string(&v)?,
                2 => r.protocols.push(enum_message(message(&v)?)?),
                4 => map_entry(message(&v)?, &mut r.parameters)?,
                _ => {}
            }
        }
        Ok(r)
    }
}

/// `DriverDeleteBucketRequest`.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct DeleteBucketRequest {
    pub bucket_id: String,
    pub parameters: BTreeMap<String, String>,
}

impl DeleteBucketRequest {
    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Self::default();
        for (n, v) in fields(b)? {
            match n {
                1 => r.bucket_id = string(&v)?,
                4 => map_entry(message(&v)?, &mut r.parameters)?,
                _ => {}
            }
        }
        Ok(r)
    }
}

/// `DriverGrantBucketAccessRequest` and `DriverRevokeBucketAccessRequest`
/// (the same numbers: 1 the account's name or id, 2 protocol, 3
/// authentication type, 4 service account, 5 parameters, 6 buckets, whose
/// access mode only a grant has).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct AccessRequest {
    pub account: String,
    pub protocol: i32,
    pub authentication_type: i32,
    pub service_account_name: String,
    pub parameters: BTreeMap<String, String>,
    /// Bucket id and access mode (0 in a revoke).
    pub buckets: Vec<(String, i32)>,
}

impl AccessRequest {
    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Self::default();
        for (n, v) in fields(b)? {
            match n {
                1 => r.account = string(&v)?,
                2 => r.protocol = enum_message(message(&v)?)?,
                3 => r.authentication_type = enum_message(message(&v)?)?,
                4 => r.service_account_name = string(&v)?,
                5 => map_entry(message(&v)?, &mut r.parameters)?,
                6 => {
                    let (mut id, mut mode) = (String::new(), 0);
                    for (n, v) in fields(message(&v)?)? {
                        match n {
                            1 => id = string(&v)?,
                            2 => mode = enum_message(message(&v)?)?,
                            _ => {}
                        }
                    }
                    r.buckets.push((id, mode));
                }
                _ => {}
            }
        }
        Ok(r)
    }
}

/// Writes messages; proto3 leaves out fields at their default (empty
/// strings, enum 0) but a sub-message that is present is written even when
/// empty: COSI reads a present `s3` as "supported".
#[derive(Default)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push(v as u8 | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }
    fn key(&mut self, number: u32, wire: u8) {
        self.varint(u64::from(number) << 3 | u64::from(wire));
    }
    pub fn string(&mut self, number: u32, s: &str) -> &mut Self {
        if !s.is_empty() {
            self.key(number, 2);
            self.varint(s.len() as u64);
            self.0.extend_from_slice(s.as_bytes());
        }
        self
    }
    pub fn enumeration(&mut self, number: u32, v: i32) -> &mut Self {
        if v != 0 {
            self.key(number, 0);
            self.varint(v as i64 as u64);
        }
        self
    }
    pub fn message(&mut self, number: u32, f: impl FnOnce(&mut Writer)) -> &mut Self {
        let mut inner = Writer::default();
        f(&mut inner);
        self.key(number, 2);
        self.varint(inner.0.len() as u64);
        self.0.extend_from_slice(&inner.0);
        self
    }
}

/// What a client needs to reach a bucket over S3.
pub struct S3Bucket<'a> {
    pub bucket_id: &'a str,
    pub endpoint: &'a str,
    pub region: &'a str,
}

/// `ObjectProtocolAndBucketInfo` with its `s3` set.
fn s3_bucket_info(w: &mut Writer, b: &S3Bucket<'_>) {
    w.message(1, |s3| {
        s3.string(1, b.bucket_id)
            .string(2, b.endpoint)
            .string(3, b.region)
            .message(4, |style| {
                style.enumeration(1, STYLE_PATH);
            });
    });
}

/// `DriverGetInfoResponse`.
pub fn get_info_response(name: &str) -> Vec<u8> {
    let mut w = Writer::default();
    w.string(1, name).message(2, |p| {
        p.enumeration(1, PROTOCOL_S3);
    });
    w.0
}

/// `DriverCreateBucketResponse` and `DriverGetExistingBucketResponse`.
pub fn bucket_response(b: &S3Bucket<'_>) -> Vec<u8> {
    let mut w = Writer::default();
    w.string(1, b.bucket_id)
        .message(2, |p| s3_bucket_info(p, b));
    w.0
}

/// `DriverGrantBucketAccessResponse`.
pub fn grant_response(
    account_id: &str,
    buckets: &[S3Bucket<'_>],
    (access_key, secret_key): (&str, &str),
) -> Vec<u8> {
    let mut w = Writer::default();
    w.string(1, account_id);
    for b in buckets {
        w.message(2, |info| {
            info.string(1, b.bucket_id)
                .message(2, |p| s3_bucket_info(p, b));
        });
    }
    w.message(3, |creds| {
        creds.message(1, |s3| {
            s3.string(1, access_key).string(2, secret_key);
        });
    });
    w.0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A grant request as a gRPC client encodes it (bytes worked out by
    /// hand from the field numbers of cosi.proto).
    #[test]
    fn a_grant_request_decodes() {
        let mut w = Writer::default();
        w.string(1, "ba-123")
            .message(2, |p| {
                p.enumeration(1, PROTOCOL_S3);
            })
            .message(3, |a| {
                a.enumeration(1, AUTH_KEY);
            })
            .message(5, |e| {
                e.string(1, "k").string(2, "v");
            })
            .message(6, |b| {
                b.string(1, "bucket-a").message(2, |m| {
                    m.enumeration(1, MODE_READ_ONLY);
                });
            })
            .message(6, |b| {
                b.string(1, "bucket-b").message(2, |m| {
                    m.enumeration(1, MODE_READ_WRITE);
                });
            });
        // An unknown field (a newer spec's) is skipped.
        w.string(15, "from the future");
        assert_eq!(
            &w.0[..8],
            &[0x0a, 6, b'b', b'a', b'-', b'1', b'2', b'3'],
            "field 1, length-delimited"
        );
        let r = AccessRequest::decode(&w.0).unwrap();
        assert_eq!(r.account, "ba-123");
        assert_eq!((r.protocol, r.authentication_type), (PROTOCOL_S3, AUTH_KEY));
        assert_eq!(r.parameters.get("k").map(String::as_str), Some("v"));
        assert_eq!(
            r.buckets,
            vec![
                ("bucket-a".to_string(), MODE_READ_ONLY),
                ("bucket-b".to_string(), MODE_READ_WRITE)
            ]
        );
    }

    #[test]
    fn malformed_messages_are_refused() {
        for bad in [
            &[0x0a, 5, b'a'][..], // length beyond the message
            &[0x08][..],          // varint missing
            &[0x00, 1][..],       // field number 0
            &[0x0b][..],          // group start
            &[
                0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
            ][..],
            &[0x0a, 2, 0xff, 0xfe][..], // not UTF-8
            &[0x12, 2, 0x0a, 9][..],    // a sub-message truncated
        ] {
            assert!(AccessRequest::decode(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            AccessRequest::decode(&[]).unwrap(),
            AccessRequest::default()
        );
    }

    #[test]
    fn responses_keep_present_empty_messages() {
        // `s3` present though every field of it is empty: "S3 supported".
        let b = S3Bucket {
            bucket_id: "",
            endpoint: "",
            region: "",
        };
        assert_eq!(
            bucket_response(&b),
            vec![0x12, 6, 0x0a, 4, 0x22, 2, 0x08, 1]
        );
        assert_eq!(
            get_info_response("t"),
            vec![0x0a, 1, b't', 0x12, 2, 0x08, 1]
        );
    }
}
