//! Browser form uploads (POST Object): what s3s does not keep of the form.
//!
//! s3s parses the form, checks the signed policy (expiry, every condition,
//! content-length-range, fields the policy does not name) and hands the
//! upload over as a PutObject, but drops the uploaded file's name, which a
//! form's `key` may name as `${filename}`. The server front feeds the
//! request body through a [`FileNameTap`] that reads the file part's
//! headers as they pass (never the file's bytes), and the operation puts
//! the object under the key with the name in place.

use std::sync::{Arc, OnceLock};

/// What the tap saw of a form once it reached the file part: the file's
/// name and the fields before it (names lowercased), which s3s reads only
/// some of.
#[derive(Debug, Clone, Default)]
pub struct FileName(pub Arc<OnceLock<Form>>);

#[derive(Debug, Clone, Default)]
pub struct Form {
    pub file_name: String,
    pub fields: Vec<(String, String)>,
}

impl Form {
    pub fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The internal response header that carries the file name substituted in
/// the key (percent-encoded) to the server front, which writes it into
/// s3s's 201 body and 303 redirect (made from the form's key as given) and
/// drops the header.
pub const FILENAME_HEADER: &str = "x-tarn-post-filename";

/// Where a form's headers may end at the latest: past this the tap stops
/// looking (the form's fields, before the file, are small).
const SCAN_MAX: usize = 1 << 20;

/// Marks a form upload (a POST Object turned into the PutObject it is).
#[derive(Debug, Clone, Copy)]
pub struct FormUpload;

/// Marks a form upload whose key had `${filename}` replaced by this name.
#[derive(Debug, Clone)]
pub struct Substituted(pub String);

/// The form fields a PUT sends as headers that Tarn reads from headers:
/// written into the request's headers so that a form is judged as the
/// same PUT would be (an ACL, encryption, an object lock honoured or
/// refused), never ignored.
pub fn fields_as_headers(
    i: &s3s::dto::PostObjectInput,
    headers: &mut http::HeaderMap,
) -> s3s::S3Result<()> {
    let fields: [(&str, Option<&str>); 12] = [
        ("x-amz-acl", i.acl.as_ref().map(|v| v.as_str())),
        ("x-amz-grant-full-control", i.grant_full_control.as_deref()),
        ("x-amz-grant-read", i.grant_read.as_deref()),
        ("x-amz-grant-read-acp", i.grant_read_acp.as_deref()),
        ("x-amz-grant-write-acp", i.grant_write_acp.as_deref()),
        (
            "x-amz-server-side-encryption",
            i.server_side_encryption.as_ref().map(|v| v.as_str()),
        ),
        (
            "x-amz-server-side-encryption-aws-kms-key-id",
            i.ssekms_key_id.as_deref(),
        ),
        (
            "x-amz-server-side-encryption-customer-algorithm",
            i.sse_customer_algorithm.as_deref(),
        ),
        (
            "x-amz-server-side-encryption-customer-key",
            i.sse_customer_key.as_deref(),
        ),
        (
            "x-amz-object-lock-mode",
            i.object_lock_mode.as_ref().map(|v| v.as_str()),
        ),
        (
            "x-amz-object-lock-legal-hold",
            i.object_lock_legal_hold_status.as_ref().map(|v| v.as_str()),
        ),
        (
            "x-amz-website-redirect-location",
            i.website_redirect_location.as_deref(),
        ),
    ];
    for (name, value) in fields {
        if let Some(v) = value {
            let v = http::HeaderValue::from_str(v).map_err(|_| {
                s3s::S3Error::with_message(
                    s3s::S3ErrorCode::InvalidArgument,
                    format!("The form field {name} is not a valid header value."),
                )
            })?;
            headers.insert(name, v);
        }
    }
    if let Some(t) = &i.object_lock_retain_until_date {
        let mut out = Vec::new();
        if t.format(s3s::dto::TimestampFormat::DateTime, &mut out)
            .is_ok()
        {
            if let Ok(v) = http::HeaderValue::from_bytes(&out) {
                headers.insert("x-amz-object-lock-retain-until-date", v);
            }
        }
    }
    Ok(())
}

/// A form's encryption fields (`x-amz-server-side-encryption*`) as the
/// headers of the PUT it is. Each must be named by a condition of the form's
/// policy: s3s exempts them from that rule (as MinIO does), which would let
/// whoever holds a signed form choose the encryption (or a customer key)
/// its signer never allowed.
pub fn encryption_fields(form: &Form, headers: &mut http::HeaderMap) -> s3s::S3Result<()> {
    let fields: Vec<&(String, String)> = form
        .fields
        .iter()
        .filter(|(k, _)| {
            k.to_ascii_lowercase()
                .starts_with("x-amz-server-side-encryption")
        })
        .collect();
    if fields.is_empty() {
        return Ok(());
    }
    let named = form.field("policy").map(policy_fields).unwrap_or_default();
    for (k, v) in fields {
        let name = k.to_ascii_lowercase();
        if !named.contains(&name) {
            return Err(s3s::S3Error::with_message(
                s3s::S3ErrorCode::AccessDenied,
                format!("Invalid according to Policy: Extra input fields: {k}"),
            ));
        }
        let value = http::HeaderValue::from_str(v).map_err(|_| {
            s3s::S3Error::with_message(
                s3s::S3ErrorCode::InvalidArgument,
                format!("The form field {k} is not a valid header value."),
            )
        })?;
        let name = http::HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
            s3s::S3Error::with_message(
                s3s::S3ErrorCode::InvalidArgument,
                format!("The form field {k} is not a valid header name."),
            )
        })?;
        headers.insert(name, value);
    }
    Ok(())
}

/// The field names (lower case) a POST policy's conditions name:
/// `{"field": "value"}` and `["eq"|"starts-with", "$field", "value"]`.
fn policy_fields(policy_b64: &str) -> Vec<String> {
    let Some(doc) = base64_simd::STANDARD
        .decode_to_vec(policy_b64.trim())
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
    else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for c in doc
        .get("conditions")
        .and_then(|c| c.as_array())
        .into_iter()
        .flatten()
    {
        if let Some(o) = c.as_object() {
            out.extend(o.keys().map(|k| k.to_ascii_lowercase()));
        } else if let Some(a) = c.as_array() {
            if let Some(f) = a.get(1).and_then(|f| f.as_str()) {
                out.push(f.trim_start_matches('$').to_ascii_lowercase());
            }
        }
    }
    out
}

/// Reads a multipart/form-data body as it streams for the headers of its
/// `file` part.
#[derive(Debug)]
pub struct FileNameTap {
    delimiter: Vec<u8>,
    buf: Vec<u8>,
    pos: usize,
    fields: Vec<(String, String)>,
    out: FileName,
    done: bool,
}

impl FileNameTap {
    /// A tap for a request of this Content-Type; None unless it is a form
    /// with a boundary.
    pub fn for_content_type(content_type: &str) -> Option<(FileNameTap, FileName)> {
        let (kind, params) = content_type.split_once(';')?;
        if !kind.trim().eq_ignore_ascii_case("multipart/form-data") {
            return None;
        }
        let boundary = params.split(';').find_map(|p| {
            let (k, v) = p.split_once('=')?;
            k.trim()
                .eq_ignore_ascii_case("boundary")
                .then(|| v.trim().trim_matches('"').to_string())
        })?;
        if boundary.is_empty() {
            return None;
        }
        let out = FileName::default();
        Some((
            FileNameTap {
                delimiter: format!("--{boundary}").into_bytes(),
                buf: Vec::new(),
                pos: 0,
                fields: Vec::new(),
                out: out.clone(),
                done: false,
            },
            out,
        ))
    }

    pub fn feed(&mut self, data: &[u8]) {
        if self.done {
            return;
        }
        self.buf.extend_from_slice(data);
        while let Some(at) = find(&self.buf[self.pos..], &self.delimiter) {
            let start = self.pos + at + self.delimiter.len();
            let Some(end) = find(&self.buf[start..], b"\r\n\r\n") else {
                break;
            };
            let headers = &self.buf[start..start + end];
            let Some((name, file)) = part_of(headers) else {
                self.stop();
                return;
            };
            if let Some(file) = file.filter(|_| name == "file") {
                let _ = self.out.0.set(Form {
                    file_name: file,
                    fields: std::mem::take(&mut self.fields),
                });
                self.stop();
                return;
            }
            // A field: its value runs to the next delimiter.
            let body = start + end + 4;
            let mut close = b"\r\n".to_vec();
            close.extend_from_slice(&self.delimiter);
            let Some(len) = find(&self.buf[body..], &close) else {
                break;
            };
            let value = String::from_utf8_lossy(&self.buf[body..body + len]).into_owned();
            self.fields.push((name, value));
            self.pos = body + len + 2;
        }
        if self.buf.len() > SCAN_MAX {
            self.stop();
        }
    }

    fn stop(&mut self) {
        self.done = true;
        self.buf = Vec::new();
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A part's field name (lowercased) and file name.
fn part_of(headers: &[u8]) -> Option<(String, Option<String>)> {
    let text = std::str::from_utf8(headers).ok()?;
    let line = text.split("\r\n").find(|l| {
        l.split_once(':')
            .is_some_and(|(k, _)| k.trim().eq_ignore_ascii_case("content-disposition"))
    })?;
    let value = line.split_once(':')?.1;
    let mut name = None;
    let mut file = None;
    for p in value.split(';').map(str::trim) {
        if let Some(v) = p.strip_prefix("name=") {
            name = Some(v.trim_matches('"'));
        } else if let Some(v) = p.strip_prefix("filename=") {
            file = Some(v.trim_matches('"'));
        }
    }
    Some((name?.to_ascii_lowercase(), file.map(str::to_string)))
}

/// The key a form names: `${filename}` replaced by the uploaded file's
/// name (as S3 does; the name as the browser sent it).
pub fn form_key(key: &str, file: Option<&str>) -> String {
    match file {
        Some(f) if key.contains("${filename}") => key.replace("${filename}", f),
        _ => key.to_string(),
    }
}

/// Percent-encodes for a URL query value (and the internal header).
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

pub fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form() -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(
            b"--XyZ\r\nContent-Disposition: form-data; name=\"key\"\r\n\r\nuploads/${filename}\r\n",
        );
        b.extend_from_slice(
            b"--XyZ\r\nContent-Disposition: form-data; name=\"policy\"\r\n\r\neyJ9\r\n",
        );
        b.extend_from_slice(b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"cat pic.jpg\"\r\nContent-Type: image/jpeg\r\n\r\n");
        b.extend_from_slice(&[0xff; 300]);
        b.extend_from_slice(b"\r\n--XyZ--\r\n");
        b
    }

    #[test]
    fn the_file_name_is_read_in_any_pieces() {
        let body = form();
        for piece in [1, 2, 7, 64, body.len()] {
            let (mut tap, name) =
                FileNameTap::for_content_type("multipart/form-data; boundary=XyZ").unwrap();
            for chunk in body.chunks(piece) {
                tap.feed(chunk);
            }
            let form = name.0.get().expect("the file part was seen");
            assert_eq!(form.file_name, "cat pic.jpg", "pieces of {piece}");
            assert_eq!(form.field("key"), Some("uploads/${filename}"));
            assert_eq!(form.field("policy"), Some("eyJ9"));
        }
        assert!(FileNameTap::for_content_type("application/json").is_none());
        assert!(FileNameTap::for_content_type("multipart/form-data").is_none());
    }

    #[test]
    fn keys_and_encoding() {
        assert_eq!(form_key("u/${filename}", Some("a.txt")), "u/a.txt");
        let policy = base64_simd::STANDARD.encode_to_string(
            br#"{"conditions":[{"bucket":"b"},["eq","$x-amz-server-side-encryption","AES256"]]}"#,
        );
        assert_eq!(
            policy_fields(&policy),
            vec!["bucket", "x-amz-server-side-encryption"]
        );
        let form = |fields: &[(&str, &str)]| Form {
            file_name: String::new(),
            fields: fields
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        let mut h = http::HeaderMap::new();
        let named = form(&[
            ("policy", &policy),
            ("x-amz-server-side-encryption", "AES256"),
        ]);
        encryption_fields(&named, &mut h).unwrap();
        assert_eq!(h["x-amz-server-side-encryption"], "AES256");
        let extra = form(&[
            ("policy", &policy),
            ("x-amz-server-side-encryption-aws-kms-key-id", "k"),
        ]);
        assert!(encryption_fields(&extra, &mut h).is_err());
        assert_eq!(form_key("u/x", Some("a.txt")), "u/x");
        assert_eq!(form_key("u/${filename}", None), "u/${filename}");
        let s = "cat pic/ü%.jpg";
        assert_eq!(percent_decode(&percent_encode(s)).as_deref(), Some(s));
    }
}
