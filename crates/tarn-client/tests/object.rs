//! The object client against a scripted S3 server in this process: merged
//! and split reads return the bytes naive reads return; 503s, resets, a
//! stalled body and a server that goes away give retries, hedges or a clear
//! error naming the object and bytes; the in-flight cap holds; uploads send
//! every part with its checksum and abort on failure. (The same client
//! against the real server: tests/test_objects.py.)

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tarn_client::object::{
    Buffer, ClientConfig, Error, Failure, ObjectClient, PutOptions, Read as ObjRead, S3Credentials,
};

/// What the next GET of an object does instead of answering plainly.
#[derive(Debug, Clone)]
enum Fault {
    Status(u16, &'static str),
    /// Sends the head and this many body bytes, then resets.
    ResetAfter(usize),
    /// Sends this many body bytes, then waits, then the rest.
    Stall(usize, Duration),
    /// Closes without answering.
    Close,
    /// A PUT answered with this status right after its head, the body left
    /// unread (the connection held open a while): the early answer of a
    /// server that refuses a body.
    Refuse(u16, &'static str),
}

#[derive(Default)]
struct State {
    objects: HashMap<String, Vec<u8>>,
    faults: VecDeque<Fault>,
    /// Faults for every GET of one key, for good.
    always: HashMap<String, Fault>,
    /// (method, path+query, Range header) of each request.
    log: Vec<(String, String, Option<String>)>,
    uploads: HashMap<String, (String, HashMap<u32, Vec<u8>>)>,
    aborted: Vec<String>,
    inflight: u64,
    inflight_max: u64,
    next_upload: u64,
}

struct Server {
    addr: String,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    listener: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    fn start() -> Server {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = format!("http://{}", l.local_addr().unwrap());
        let state = Arc::new(Mutex::new(State::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sp) = (state.clone(), stop.clone());
        let listener = std::thread::spawn(move || {
            l.set_nonblocking(true).unwrap();
            while !sp.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((s, _)) => {
                        s.set_nonblocking(false).unwrap();
                        let st = st.clone();
                        let sp = sp.clone();
                        std::thread::spawn(move || serve(s, st, sp));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Server {
            addr,
            state,
            stop,
            listener: Some(listener),
        }
    }

    fn put(&self, key: &str, data: Vec<u8>) {
        self.state.lock().unwrap().objects.insert(key.into(), data);
    }

    fn fault(&self, f: Fault) {
        self.state.lock().unwrap().faults.push_back(f);
    }

    /// A fault for every request on `key` ("bucket/key"), for good.
    fn always(&self, key: &str, f: Fault) {
        self.state.lock().unwrap().always.insert(key.into(), f);
    }

    fn log(&self) -> Vec<(String, String, Option<String>)> {
        self.state.lock().unwrap().log.clone()
    }

    /// Stops accepting and ends every connection.
    fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.listener.take() {
            h.join().unwrap();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

fn etag_of(data: &[u8]) -> String {
    format!("\"{:08x}{}\"", tarn_wire::proto::crc32c(data), data.len())
}

fn respond(
    s: &mut TcpStream,
    status: u16,
    headers: &[(&str, String)],
    body: &[u8],
) -> std::io::Result<()> {
    let mut h = format!("HTTP/1.1 {status} X\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        h.push_str(&format!("{k}: {v}\r\n"));
    }
    h.push_str("\r\n");
    s.write_all(h.as_bytes())?;
    s.write_all(body)
}

fn error_body(code: &str) -> Vec<u8> {
    format!("<Error><Code>{code}</Code><Message>scripted {code}</Message></Error>").into_bytes()
}

fn serve(s: TcpStream, st: Arc<Mutex<State>>, stop: Arc<AtomicBool>) {
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut w = s.try_clone().unwrap();
    let mut r = BufReader::new(s);
    loop {
        let mut line = String::new();
        match r.read_line(&mut line) {
            Ok(0) => return,
            Ok(_) => {}
            Err(_) if !stop.load(Ordering::Relaxed) => continue,
            Err(_) => return,
        }
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let mut parts = line.split_whitespace();
        let method = parts.next().unwrap_or("").to_string();
        let target = parts.next().unwrap_or("").to_string();
        let mut headers = HashMap::new();
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).is_err() {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
            }
        }
        let len: usize = headers
            .get("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let (path0, _) = target.split_once('?').unwrap_or((&target, ""));
        let refuse = st
            .lock()
            .unwrap()
            .always
            .get(path0.trim_start_matches('/'))
            .cloned();
        if let (Some(Fault::Refuse(code, name)), "PUT") = (refuse, method.as_str()) {
            let _ = respond(&mut w, code, &[], &error_body(name));
            std::thread::sleep(Duration::from_secs(2));
            return;
        }
        let mut body = vec![0u8; len];
        if r.read_exact(&mut body).is_err() {
            return;
        }
        assert!(headers.contains_key("authorization"), "requests are signed");
        let (path, query) = target.split_once('?').unwrap_or((&target, ""));
        let key = path.trim_start_matches('/').to_string();
        st.lock().unwrap().log.push((
            method.clone(),
            target.clone(),
            headers.get("range").cloned(),
        ));
        let ok = match method.as_str() {
            "GET" if query.starts_with("list-type") => list(&mut w, &st, &key, query),
            "GET" => get(&mut w, &st, &key, &headers, &stop),
            "HEAD" => {
                let o = st.lock().unwrap().objects.get(&key).cloned();
                match o {
                    Some(d) => {
                        let h = format!(
                            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nETag: {}\r\n\r\n",
                            d.len(),
                            etag_of(&d)
                        );
                        w.write_all(h.as_bytes()).is_ok()
                    }
                    None => w
                        .write_all(b"HTTP/1.1 404 X\r\nContent-Length: 0\r\n\r\n")
                        .is_ok(),
                }
            }
            "PUT" | "POST" | "DELETE" => {
                write_op(&mut w, &st, &method, &key, query, &headers, body)
            }
            _ => false,
        };
        if !ok {
            return;
        }
    }
}

fn get(
    w: &mut TcpStream,
    st: &Arc<Mutex<State>>,
    key: &str,
    headers: &HashMap<String, String>,
    stop: &AtomicBool,
) -> bool {
    let (data, fault) = {
        let mut s = st.lock().unwrap();
        let fault = s.always.get(key).cloned().or_else(|| s.faults.pop_front());
        (s.objects.get(key).cloned(), fault)
    };
    let Some(data) = data else {
        return respond(w, 404, &[], &error_body("NoSuchKey")).is_ok();
    };
    if let Some(m) = headers.get("if-match") {
        if *m != etag_of(&data) {
            return respond(w, 412, &[], &error_body("PreconditionFailed")).is_ok();
        }
    }
    let (a, b) = match headers.get("range").and_then(|r| r.strip_prefix("bytes=")) {
        Some(r) => {
            let (a, b) = r.split_once('-').unwrap();
            let a: usize = a.parse().unwrap();
            let b: usize = b
                .parse::<usize>()
                .unwrap()
                .min(data.len().saturating_sub(1));
            if a >= data.len() {
                return respond(
                    w,
                    416,
                    &[("Content-Range", format!("bytes */{}", data.len()))],
                    &error_body("InvalidRange"),
                )
                .is_ok();
            }
            (a, b)
        }
        None => (0, data.len() - 1),
    };
    let span = (b + 1 - a) as u64;
    {
        let mut s = st.lock().unwrap();
        s.inflight += span;
        s.inflight_max = s.inflight_max.max(s.inflight);
    }
    let done = |st: &Arc<Mutex<State>>| st.lock().unwrap().inflight -= span;
    let head = format!(
        "HTTP/1.1 206 Partial Content\r\nContent-Length: {span}\r\nContent-Range: bytes {a}-{b}/{}\r\nETag: {}\r\n\r\n",
        data.len(),
        etag_of(&data)
    );
    let body = &data[a..=b];
    // The count drops before the last byte goes out, so that no client sees
    // its answer whole while it still counts.
    let last = |w: &mut TcpStream, from: usize| {
        let ok = w.write_all(&body[from..body.len() - 1]).is_ok();
        done(st);
        ok && w.write_all(&body[body.len() - 1..]).is_ok()
    };
    let ok = match fault {
        None => w.write_all(head.as_bytes()).is_ok() && last(w, 0),
        Some(Fault::Status(code, name)) | Some(Fault::Refuse(code, name)) => {
            done(st);
            respond(w, code, &[], &error_body(name)).is_ok()
        }
        Some(Fault::Close) => {
            done(st);
            false
        }
        Some(Fault::ResetAfter(n)) => {
            let _ = w.write_all(head.as_bytes());
            let _ = w.write_all(&body[..n.min(body.len())]);
            let _ = w.flush();
            // SO_LINGER 0: a reset, not a clean close.
            let l = libc::linger {
                l_onoff: 1,
                l_linger: 0,
            };
            // SAFETY: setsockopt on a live socket with a linger struct.
            unsafe {
                libc::setsockopt(
                    std::os::fd::AsRawFd::as_raw_fd(w),
                    libc::SOL_SOCKET,
                    libc::SO_LINGER,
                    (&l as *const libc::linger).cast(),
                    std::mem::size_of::<libc::linger>() as u32,
                );
            }
            let _ = w.shutdown(std::net::Shutdown::Both);
            done(st);
            false
        }
        Some(Fault::Stall(n, d)) => {
            let n = n.min(body.len());
            let ok = w
                .write_all(head.as_bytes())
                .and_then(|_| w.write_all(&body[..n]))
                .is_ok();
            let until = std::time::Instant::now() + d;
            while std::time::Instant::now() < until {
                if stop.load(Ordering::Relaxed) {
                    // The server goes away mid-body.
                    st.lock().unwrap().inflight -= span;
                    return false;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            ok && last(w, n)
        }
    };
    ok
}

fn list(w: &mut TcpStream, st: &Arc<Mutex<State>>, bucket: &str, query: &str) -> bool {
    let prefix = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("prefix="))
        .unwrap_or("")
        .replace("%2F", "/");
    let s = st.lock().unwrap();
    let mut keys: Vec<(&String, &Vec<u8>)> = s
        .objects
        .iter()
        .filter(|(k, _)| k.starts_with(&format!("{bucket}/{prefix}")))
        .collect();
    keys.sort();
    let mut x = String::from("<ListBucketResult><IsTruncated>false</IsTruncated>");
    for (k, d) in keys {
        x.push_str(&format!(
            "<Contents><Key>{}</Key><Size>{}</Size><ETag>{}</ETag></Contents>",
            k.strip_prefix(&format!("{bucket}/"))
                .unwrap()
                .replace('&', "&amp;"),
            d.len(),
            etag_of(d).replace('"', "&quot;")
        ));
    }
    x.push_str("</ListBucketResult>");
    drop(s);
    respond(w, 200, &[], x.as_bytes()).is_ok()
}

fn write_op(
    w: &mut TcpStream,
    st: &Arc<Mutex<State>>,
    method: &str,
    key: &str,
    query: &str,
    headers: &HashMap<String, String>,
    body: Vec<u8>,
) -> bool {
    let q: HashMap<&str, &str> = query
        .split('&')
        .filter(|s| !s.is_empty())
        .map(|kv| kv.split_once('=').unwrap_or((kv, "")))
        .collect();
    let mut s = st.lock().unwrap();
    if method == "PUT" {
        // Every body carries its CRC32C; a wrong one is refused, as S3 does.
        let want = headers
            .get("x-amz-checksum-crc32c")
            .cloned()
            .unwrap_or_default();
        let crc = tarn_wire::proto::crc32c(&body).to_be_bytes();
        if want != b64(&crc) {
            drop(s);
            return respond(w, 400, &[], &error_body("BadDigest")).is_ok();
        }
        if let Some(f) = s.always.get(key).cloned() {
            drop(s);
            if let Fault::Status(code, name) = f {
                return respond(w, code, &[], &error_body(name)).is_ok();
            }
            return false;
        }
        if let Some(id) = q.get("uploadId") {
            let n: u32 = q["partNumber"].parse().unwrap();
            let etag = etag_of(&body);
            s.uploads.get_mut(*id).unwrap().1.insert(n, body);
            drop(s);
            return respond(w, 200, &[("ETag", etag)], b"").is_ok();
        }
        let etag = etag_of(&body);
        s.objects.insert(key.into(), body);
        drop(s);
        return respond(w, 200, &[("ETag", etag)], b"").is_ok();
    }
    if method == "POST" && q.contains_key("uploads") {
        s.next_upload += 1;
        let id = format!("up{}", s.next_upload);
        s.uploads.insert(id.clone(), (key.into(), HashMap::new()));
        drop(s);
        let x = format!("<InitiateMultipartUploadResult><UploadId>{id}</UploadId></InitiateMultipartUploadResult>");
        return respond(w, 200, &[], x.as_bytes()).is_ok();
    }
    if method == "POST" {
        let id = q["uploadId"];
        let (k, parts) = s.uploads.remove(id).unwrap();
        let doc = String::from_utf8(body).unwrap();
        let mut data = Vec::new();
        for (i, _) in doc.match_indices("<PartNumber>") {
            let rest = &doc[i + 12..];
            let n: u32 = rest[..rest.find('<').unwrap()].parse().unwrap();
            data.extend_from_slice(&parts[&n]);
        }
        let etag = format!("\"{}-{}\"", etag_of(&data).trim_matches('"'), parts.len());
        s.objects.insert(k, data);
        drop(s);
        let x = format!(
            "<CompleteMultipartUploadResult><ETag>{}</ETag></CompleteMultipartUploadResult>",
            etag.replace('"', "&quot;")
        );
        return respond(w, 200, &[], x.as_bytes()).is_ok();
    }
    // DELETE ?uploadId: abort.
    let id = q.get("uploadId").map(|s| s.to_string()).unwrap_or_default();
    s.uploads.remove(&id);
    s.aborted.push(id);
    drop(s);
    respond(w, 204, &[], b"").is_ok()
}

fn b64(b: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let n = (u32::from(b[0]) << 24)
        | (u32::from(b[1]) << 16)
        | (u32::from(b[2]) << 8)
        | u32::from(b[3]);
    let n = u64::from(n) << 4; // 36 bits: six symbols, then "=="
    let mut out: String = (0..6)
        .map(|k| T[((n >> (30 - 6 * k)) & 63) as usize] as char)
        .collect();
    out.push_str("==");
    out
}

fn config(server: &Server) -> ClientConfig {
    ClientConfig {
        endpoints: vec![server.addr.clone()],
        credentials: Some(S3Credentials {
            access_key: "ak".into(),
            secret_key: "sk".into(),
            session_token: None,
        }),
        connections: 4,
        chunk_bytes: 64 << 10,
        stripe_bytes: 16 << 10,
        merge_gap_bytes: 4 << 10,
        backoff_base: Duration::from_millis(5),
        backoff_max: Duration::from_millis(20),
        io_timeout: Duration::from_secs(10),
        ..ClientConfig::default()
    }
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn batched_reads_equal_naive_reads() {
    let server = Server::start();
    let objects: Vec<Vec<u8>> = (0..3)
        .map(|i| pattern(300_000 + i * 7777, i as u64))
        .collect();
    for (i, d) in objects.iter().enumerate() {
        server.put(&format!("b/obj{i}"), d.clone());
    }
    let client = ObjectClient::new(config(&server)).unwrap();
    // Many reads: small neighbours that merge, large ones that split, odd
    // offsets, empty ones, reads of the same bytes into two places.
    let mut specs = Vec::new();
    let mut rng = pattern(4096, 99).into_iter().map(u64::from);
    for i in 0..120 {
        let o = (i % 3) as usize;
        let size = objects[o].len() as u64;
        let r = rng.next().unwrap() * rng.next().unwrap();
        let len = match i % 5 {
            0 => 0,
            1 => 200_000.min(size),
            _ => 1 + r % 3000,
        };
        let off = (rng.next().unwrap() * 1187 + r) % (size - len + 1);
        specs.push((o, off, len));
    }
    let total: u64 = specs.iter().map(|s| s.2).sum();
    let buf = Buffer::zeroed(total as usize);
    let names: Vec<String> = (0..3).map(|i| format!("obj{i}")).collect();
    let mut at = 0u64;
    let reads: Vec<ObjRead<'_>> = specs
        .iter()
        .enumerate()
        .map(|(i, &(o, off, len))| {
            let r = ObjRead::new("b", &names[o], off, len, &buf, at, i as u64);
            at += len;
            r
        })
        .collect();
    let results = client.read(&reads).unwrap();
    let mut at = 0usize;
    for (i, (r, &(o, off, len))) in results.iter().zip(&specs).enumerate() {
        assert_eq!(r.as_ref().unwrap(), &len, "read {i}");
        let got = unsafe { buf.copy_out(at, len as usize) };
        assert!(
            got == objects[o][off as usize..(off + len) as usize],
            "read {i} ({o}, {off}, {len}) got other bytes"
        );
        at += len as usize;
    }
    // Reads one by one, each cut into 64 KiB requests, would take this many.
    let naive: u64 = specs.iter().map(|s| s.2.div_ceil(64 << 10)).sum();
    let gets = server.log().iter().filter(|l| l.0 == "GET").count() as u64;
    assert!(
        gets < naive,
        "close reads merge: {gets} GETs, {naive} one read at a time"
    );
    // A 200 KB read with 64 KiB chunks is split over several requests.
    assert!(server
        .log()
        .iter()
        .any(
            |l| l.2.as_deref().is_some_and(|r| r.starts_with("bytes=") && {
                let (a, b) = r[6..].split_once('-').unwrap();
                let (a, b): (u64, u64) = (a.parse().unwrap(), b.parse().unwrap());
                a % (64 << 10) == 0 && b - a + 1 == 64 << 10
            })
        ));
}

#[test]
fn transient_errors_are_retried_and_resume_where_they_stopped() {
    let server = Server::start();
    let data = pattern(50_000, 1);
    server.put("b/k", data.clone());
    let client = ObjectClient::new(config(&server)).unwrap();
    let buf = Buffer::zeroed(data.len());
    server.fault(Fault::Status(503, "SlowDown"));
    server.fault(Fault::ResetAfter(20_000));
    server.fault(Fault::Close);
    let r = client
        .read(&[ObjRead::new("b", "k", 0, 50_000, &buf, 0, 0)])
        .unwrap();
    assert_eq!(r[0].as_ref().unwrap(), &50_000);
    assert!(unsafe { buf.as_slice() } == &data[..]);
    let ranges: Vec<String> = server.log().into_iter().filter_map(|l| l.2).collect();
    assert_eq!(ranges[0], "bytes=0-49999");
    // After the reset at 20,000 bytes only the rest is asked for.
    assert_eq!(ranges.last().unwrap(), "bytes=20000-49999", "{ranges:?}");
    assert_eq!(client.stats().retries, 3);
}

#[test]
fn failures_name_the_object_and_the_bytes() {
    let server = Server::start();
    server.put("b/k", pattern(10_000, 2));
    let mut cfg = config(&server);
    cfg.retries = 2;
    let client = ObjectClient::new(cfg).unwrap();
    let buf = Buffer::zeroed(20_000);
    for _ in 0..3 {
        server.fault(Fault::Status(500, "InternalError"));
    }
    let r = client
        .read(&[ObjRead::new("b", "k", 100, 900, &buf, 0, 0)])
        .unwrap();
    let e = r[0].clone().unwrap_err();
    assert_eq!(e.attempts, 3);
    assert_eq!(
        e.to_string(),
        "s3://b/k bytes 100-999: HTTP 500 InternalError: scripted InternalError (after 3 attempts)"
    );

    // Not retried: missing objects, reads past the end, changed objects.
    let before = server.log().len();
    let r = client
        .read(&[
            ObjRead::new("b", "missing", 0, 10, &buf, 0, 0),
            ObjRead::new("b", "k", 9_000, 2_000, &buf, 100, 1),
            ObjRead::new("b", "k", 0, 10, &buf, 5_000, 2).if_match("\"stale\""),
        ])
        .unwrap();
    assert_eq!(server.log().len() - before, 3, "one request each");
    let e0 = r[0].clone().unwrap_err();
    assert!(matches!(e0.failure, Failure::NotFound { .. }), "{e0}");
    assert!(e0
        .to_string()
        .starts_with("s3://b/missing bytes 0-9: not found"));
    let e1 = r[1].clone().unwrap_err();
    assert_eq!(
        e1.failure,
        Failure::OutOfRange { size: Some(10_000) },
        "{e1}"
    );
    assert_eq!(r[2].clone().unwrap_err().failure, Failure::Changed);

    // A bad call is refused before anything is sent.
    let small = Buffer::zeroed(10);
    assert!(matches!(
        client.read(&[ObjRead::new("b", "k", 0, 11, &small, 0, 0)]),
        Err(Error::Usage(_))
    ));
    assert!(matches!(
        client.read(&[
            ObjRead::new("b", "k", 0, 6, &small, 0, 0),
            ObjRead::new("b", "k", 0, 4, &small, 5, 1)
        ]),
        Err(Error::Usage(_))
    ));
}

#[test]
fn a_stalled_body_is_hedged() {
    let server = Server::start();
    let data = pattern(64 << 10, 3);
    server.put("b/k", data.clone());
    let mut cfg = config(&server);
    cfg.hedge_min = Duration::from_millis(50);
    let client = ObjectClient::new(cfg).unwrap();
    let buf = Buffer::zeroed(data.len());
    // Enough quick reads for the client to know what is normal.
    for _ in 0..10 {
        client
            .read(&[ObjRead::new("b", "k", 0, 64 << 10, &buf, 0, 0)])
            .unwrap()[0]
            .as_ref()
            .unwrap();
    }
    // The next answer stalls for 30 s after 1000 bytes; the hedge answers.
    server.fault(Fault::Stall(1000, Duration::from_secs(30)));
    let ring = client.ring();
    ring.submit(&[ObjRead::new("b", "k", 0, 64 << 10, &buf, 0, 5)])
        .unwrap();
    let c = ring.wait(1, Some(Duration::from_secs(20)));
    assert_eq!(c.len(), 1, "the stalled read was not rescued by a hedge");
    assert_eq!(c[0].result.as_ref().unwrap(), &(64 << 10));
    assert!(unsafe { buf.as_slice() } == &data[..]);
    let s = client.stats();
    assert!(s.hedges >= 1 && s.hedges_won >= 1, "{s:?}");
}

#[test]
fn a_server_that_goes_away_gives_a_clear_error() {
    let mut server = Server::start();
    server.put("b/k", pattern(1 << 20, 4));
    let mut cfg = config(&server);
    cfg.retries = 3;
    cfg.hedge = false;
    cfg.connect_timeout = Duration::from_millis(500);
    let client = ObjectClient::new(cfg).unwrap();
    let buf = Buffer::zeroed(1 << 20);
    // The answer stalls; the server stops meanwhile.
    server.fault(Fault::Stall(100, Duration::from_millis(300)));
    let ring = client.ring();
    ring.submit(&[ObjRead::new("b", "k", 0, 1 << 20, &buf, 0, 0)])
        .unwrap();
    server.stop();
    let c = ring.wait(1, Some(Duration::from_secs(30)));
    assert_eq!(c.len(), 1, "no hang");
    let e = c[0].result.clone().unwrap_err();
    assert!(matches!(e.failure, Failure::Io { .. }), "{e}");
    assert!(e.to_string().starts_with("s3://b/k bytes "), "{e}");
}

#[test]
fn bytes_in_flight_stay_under_the_cap() {
    let server = Server::start();
    let data = pattern(2 << 20, 5);
    server.put("b/k", data.clone());
    let mut cfg = config(&server);
    cfg.connections = 8;
    cfg.hedge = false;
    cfg.max_inflight_bytes = 128 << 10;
    let client = ObjectClient::new(cfg).unwrap();
    let buf = Buffer::zeroed(data.len());
    for _ in 0..8 {
        server.fault(Fault::Stall(10, Duration::from_millis(20)));
    }
    let r = client
        .read(&[ObjRead::new("b", "k", 0, 2 << 20, &buf, 0, 0)])
        .unwrap();
    assert!(r[0].is_ok());
    assert!(unsafe { buf.as_slice() } == &data[..]);
    let max = server.state.lock().unwrap().inflight_max;
    assert!(max <= 128 << 10, "{max} bytes in flight");
    assert!(max >= 64 << 10);
}

#[test]
fn cancel_and_drop_leave_no_io_in_flight() {
    let server = Server::start();
    server.put("b/k", pattern(512 << 10, 6));
    let mut cfg = config(&server);
    cfg.hedge = false;
    let client = ObjectClient::new(cfg).unwrap();
    let buf = Buffer::zeroed(512 << 10);
    for _ in 0..4 {
        server.fault(Fault::Stall(10, Duration::from_millis(400)));
    }
    let ring = client.ring();
    ring.submit(&[ObjRead::new("b", "k", 0, 512 << 10, &buf, 0, 9)])
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    ring.cancel();
    let c = ring.wait(1, Some(Duration::from_secs(10)));
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].result.clone().unwrap_err().failure, Failure::Cancelled);
    assert_eq!(ring.pending(), 0);
    // Dropping a ring with reads running waits for them.
    let ring = client.ring();
    let b2 = Buffer::zeroed(512 << 10);
    ring.submit(&[ObjRead::new("b", "k", 0, 512 << 10, &b2, 0, 1)])
        .unwrap();
    drop(ring);
    drop(b2);
}

#[test]
fn uploads_go_in_parallel_parts_with_checksums() {
    let server = Server::start();
    let client = ObjectClient::new(config(&server)).unwrap();
    let data = pattern(23 << 20, 7);
    let buf = Buffer::from_vec(data.clone());
    let opts = PutOptions {
        part_bytes: Some(5 << 20),
        ..PutOptions::default()
    };
    let etag = client
        .put("b", "big", &buf, 0, data.len() as u64, &opts)
        .unwrap();
    assert!(etag.ends_with("-5\""), "{etag}");
    assert!(server.state.lock().unwrap().objects["b/big"] == data);
    let small = client.put("b", "small", &buf, 7, 1000, &opts).unwrap();
    assert_eq!(small, etag_of(&data[7..1007]));
    let info = client.head("b", "small").unwrap();
    assert_eq!((info.size, info.etag.as_str()), (1000, small.as_str()));
    let listed = client.list("b", "").unwrap();
    assert_eq!(
        listed
            .iter()
            .map(|l| (l.key.as_str(), l.size))
            .collect::<Vec<_>>(),
        vec![("big", 23 << 20), ("small", 1000)]
    );

    // A part that fails for good aborts the upload.
    server.always("b/doomed", Fault::Status(400, "InvalidPart"));
    let e = client
        .put("b", "doomed", &buf, 0, 12 << 20, &opts)
        .unwrap_err();
    assert!(e.to_string().starts_with("s3://b/doomed bytes "), "{e}");
    let s = server.state.lock().unwrap();
    assert_eq!(s.aborted.len(), 1);
    assert!(!s.objects.contains_key("b/doomed"));
}

#[test]
fn a_streamed_upload_reuses_its_buffers_and_appears_only_when_completed() {
    let server = Server::start();
    let client = ObjectClient::new(config(&server)).unwrap();
    let part = 5usize << 20;
    let data = pattern(4 * part + 1234, 11);
    // Two staging buffers, each reused once its part is done, parts sent
    // out of order: the object is the parts in number order.
    let slots = [Buffer::zeroed(part), Buffer::zeroed(part)];
    let mp = client
        .multipart("b", "streamed", &PutOptions::default())
        .unwrap();
    let order = [2u32, 1, 4, 3, 5];
    let mut free: Vec<usize> = vec![0, 1];
    let mut busy: HashMap<u32, usize> = HashMap::new();
    for n in order {
        if free.is_empty() {
            for (done, r) in mp.wait_parts(1, None) {
                r.unwrap();
                free.push(busy.remove(&done).unwrap());
            }
        }
        let slot = free.pop().unwrap();
        let at = (n as usize - 1) * part;
        let len = part.min(data.len() - at);
        // SAFETY: the slot's last part is done; nothing reads it now.
        unsafe {
            std::ptr::copy_nonoverlapping(data[at..].as_ptr(), slots[slot].as_ptr(), len);
        }
        mp.send_part(n, at as u64, &slots[slot], 0, len as u64)
            .unwrap();
        busy.insert(n, slot);
    }
    let e = mp.send_part(3, 0, &slots[0], 0, 1).unwrap_err();
    assert!(e.to_string().contains("part 3 was sent already"), "{e}");
    assert!(!server
        .state
        .lock()
        .unwrap()
        .objects
        .contains_key("b/streamed"));
    let etag = mp.complete().unwrap();
    assert!(etag.ends_with("-5\""), "{etag}");
    assert!(server.state.lock().unwrap().objects["b/streamed"] == data);
    assert!(mp.complete().is_err(), "completed twice");

    // Aborted, or dropped before completion: nothing appears, the upload is
    // aborted on the server.
    let mp = client
        .multipart("b", "dropped", &PutOptions::default())
        .unwrap();
    mp.send_part(1, 0, &slots[0], 0, part as u64).unwrap();
    drop(mp);
    let mp = client
        .multipart("b", "aborted", &PutOptions::default())
        .unwrap();
    mp.send_part(1, 0, &slots[1], 0, part as u64).unwrap();
    mp.abort().unwrap();
    assert!(mp.send_part(2, 0, &slots[1], 0, 1).is_err());
    let s = server.state.lock().unwrap();
    assert_eq!(s.aborted.len(), 2);
    assert!(!s.objects.contains_key("b/dropped") && !s.objects.contains_key("b/aborted"));
    drop(s);

    // A part that fails for good: its completion says so, and completing
    // reports it (naming the bytes) and aborts.
    server.always("b/doomed", Fault::Status(400, "InvalidPart"));
    let mp = client
        .multipart("b", "doomed", &PutOptions::default())
        .unwrap();
    mp.send_part(1, 0, &slots[0], 0, part as u64).unwrap();
    let done = mp.wait_parts(1, Some(Duration::from_secs(10)));
    assert_eq!(done.len(), 1);
    assert!(done[0].1.is_err());
    let e = mp.complete().unwrap_err();
    assert!(e.to_string().starts_with("s3://b/doomed bytes 0-"), "{e}");
    assert_eq!(server.state.lock().unwrap().aborted.len(), 3);
    let mp = client
        .multipart("b", "empty", &PutOptions::default())
        .unwrap();
    assert!(mp
        .complete()
        .unwrap_err()
        .to_string()
        .contains("at least one part"));
}

#[test]
fn a_body_refused_early_reports_the_server_s_answer() {
    let server = Server::start();
    let client = ObjectClient::new(ClientConfig {
        io_timeout: Duration::from_millis(300),
        retries: 1,
        ..config(&server)
    })
    .unwrap();
    server.always("b/refused", Fault::Refuse(503, "ServiceUnavailable"));
    // The server answers and stops reading: the send stalls, and the
    // answer, not the stalled send, is what the error says.
    let data = pattern(16 << 20, 3);
    let buf = Buffer::from_vec(data);
    let opts = PutOptions {
        part_bytes: Some(64 << 20),
        ..PutOptions::default()
    };
    let e = client
        .put("b", "refused", &buf, 0, 16 << 20, &opts)
        .unwrap_err();
    let Error::Object(o) = &e else { panic!("{e}") };
    assert!(
        matches!(o.failure, Failure::Status { status: 503, .. }),
        "{e}"
    );
    assert_eq!(o.attempts, 2, "{e}");
}

#[test]
fn many_rings_share_one_client() {
    let server = Server::start();
    let data = Arc::new(pattern(256 << 10, 8));
    server.put("b/k", (*data).clone());
    let client = ObjectClient::new(config(&server)).unwrap();
    let total = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let (client, data, total) = (client.clone(), data.clone(), total.clone());
            std::thread::spawn(move || {
                let ring = client.ring();
                let buf = Buffer::zeroed(data.len());
                for round in 0..5u64 {
                    let off = t * 1000 + round * 77;
                    ring.submit(&[ObjRead::new("b", "k", off, 100_000, &buf, 0, round)])
                        .unwrap();
                    let c = ring.wait(1, None);
                    assert_eq!(c[0].user_data, round);
                    assert!(
                        unsafe { buf.copy_out(0, 100_000) }
                            == data[off as usize..off as usize + 100_000]
                    );
                    total.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(total.load(Ordering::Relaxed), 20);
}
