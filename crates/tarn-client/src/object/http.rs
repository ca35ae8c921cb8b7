//! A keep-alive HTTP/1.1 connection, as little of one as S3 needs, written
//! so that response bodies land in the caller's memory straight from the
//! socket: the head is read into a small buffer, the body with `read()`
//! into the destination (only the few body bytes that arrived with the head
//! are copied). Blocking sockets, one request at a time per connection; the
//! object client runs one per worker thread. Over TLS (an https://
//! endpoint) the body is decrypted into the destination by rustls, with the
//! same one copy.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use tarn_io::tls::rustls;

/// What a TLS connection is made with: the client configuration (its
/// trusted roots) and the name the certificate must carry.
pub type TlsTarget = (
    Arc<rustls::ClientConfig>,
    rustls::pki_types::ServerName<'static>,
);

/// A plain or TLS stream over one TCP socket.
enum Stream {
    Plain(TcpStream),
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
}

impl Stream {
    fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => &s.sock,
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write(buf),
            Stream::Tls(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Plain(s) => s.flush(),
            Stream::Tls(s) => s.flush(),
        }
    }
}

/// Most bytes a response head may take.
const HEAD_MAX: usize = 64 << 10;
/// What is read into the head buffer at a time.
const HEAD_READ: usize = 16 << 10;

/// How a response's body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body {
    Length(u64),
    Chunked,
    /// Until the server closes the connection.
    Close,
}

#[derive(Debug)]
pub struct Head {
    pub status: u16,
    /// Names lowercased.
    pub headers: Vec<(String, String)>,
    pub body: Body,
    /// The server will close the connection after this response.
    pub close: bool,
}

impl Head {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

pub struct Conn {
    stream: Stream,
    pub endpoint: usize,
    /// Bytes read from the socket past the response head: `buf[at..end]`.
    buf: Box<[u8]>,
    at: usize,
    end: usize,
    /// Requests sent on this connection.
    pub uses: u64,
    /// Left mid-response: unusable for another request.
    broken: bool,
}

impl Conn {
    /// A connection to `addr`; with `tls`, after a complete handshake (a
    /// certificate the roots do not trust, or one for another name, fails
    /// here as `InvalidData`).
    pub fn connect(
        addr: &SocketAddr,
        endpoint: usize,
        (connect_timeout, io_timeout): (Duration, Duration),
        tls: Option<&TlsTarget>,
    ) -> io::Result<Conn> {
        // A node on this host: no pacing of what this client sends (its
        // PUTs), which loopback has no link for (`tarn_io::net`).
        let tcp = tarn_io::net::connect(addr, connect_timeout)?;
        tcp.set_nodelay(true)?;
        tcp.set_read_timeout(Some(io_timeout))?;
        tcp.set_write_timeout(Some(io_timeout))?;
        let stream = match tls {
            None => Stream::Plain(tcp),
            Some((config, name)) => {
                let mut conn = rustls::ClientConnection::new(config.clone(), name.clone())
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                let mut tcp = tcp;
                // The handshake within the connect timeout.
                tcp.set_read_timeout(Some(connect_timeout))?;
                while conn.is_handshaking() {
                    conn.complete_io(&mut tcp)?;
                }
                tcp.set_read_timeout(Some(io_timeout))?;
                Stream::Tls(Box::new(rustls::StreamOwned::new(conn, tcp)))
            }
        };
        Ok(Conn {
            stream,
            endpoint,
            buf: vec![0u8; HEAD_MAX].into_boxed_slice(),
            at: 0,
            end: 0,
            uses: 0,
            broken: false,
        })
    }

    pub fn fd(&self) -> i32 {
        self.stream.tcp().as_raw_fd()
    }

    /// True when another request may follow on this connection.
    pub fn reusable(&self) -> bool {
        !self.broken
    }

    pub fn mark_broken(&mut self) {
        self.broken = true;
    }

    /// Sends a request: the head, then `body` as it lies in memory.
    pub fn send(&mut self, head: &[u8], body: &[u8]) -> io::Result<()> {
        self.uses += 1;
        self.at = 0;
        self.end = 0;
        // Broken until the response has been read whole.
        self.broken = true;
        if body.is_empty() || body.len() <= 16 << 10 {
            // One segment for small requests.
            let mut v = Vec::with_capacity(head.len() + body.len());
            v.extend_from_slice(head);
            v.extend_from_slice(body);
            return self.stream.write_all(&v);
        }
        self.stream.write_all(head)?;
        self.stream.write_all(body)
    }

    /// Reads the response head. A connection that the server closed before
    /// answering reads as `UnexpectedEof` with no bytes received, which a
    /// caller retries on a fresh connection.
    pub fn read_head(&mut self) -> io::Result<Head> {
        loop {
            if self.end > 0 {
                let mut headers = [httparse::EMPTY_HEADER; 64];
                let mut r = httparse::Response::new(&mut headers);
                match r.parse(&self.buf[..self.end]) {
                    Ok(httparse::Status::Complete(n)) => {
                        let head = parse_head(&r)?;
                        if head.status == 100 {
                            // 100-continue: the real head follows.
                            self.buf.copy_within(n..self.end, 0);
                            self.end -= n;
                            continue;
                        }
                        self.at = n;
                        return Ok(head);
                    }
                    Ok(httparse::Status::Partial) => {}
                    Err(e) => return Err(invalid(format!("malformed response head: {e}"))),
                }
            }
            if self.end == HEAD_MAX {
                return Err(invalid("response head over 64 KiB".into()));
            }
            let want = (self.end + HEAD_READ).min(HEAD_MAX);
            let n = self.stream.read(&mut self.buf[self.end..want])?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    if self.end == 0 {
                        "the server closed the connection before answering"
                    } else {
                        "the server closed the connection mid-head"
                    },
                ));
            }
            self.end += n;
        }
    }

    /// After a failed send: the response head the server may have sent
    /// before it closed (an early answer to a body it refused), waiting at
    /// most `wait` for it. The connection is not reused either way.
    pub fn read_early_head(&mut self, wait: Duration) -> io::Result<Head> {
        self.broken = true;
        self.stream
            .tcp()
            .set_read_timeout(Some(wait.max(Duration::from_millis(1))))?;
        self.read_head()
    }

    /// Reads body bytes into `dst`: first what came with the head, then from
    /// the socket. Returns the count read (0 at end of stream).
    pub fn read_body(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        if dst.is_empty() {
            return Ok(0);
        }
        if self.at < self.end {
            let n = (self.end - self.at).min(dst.len());
            dst[..n].copy_from_slice(&self.buf[self.at..self.at + n]);
            self.at += n;
            return Ok(n);
        }
        loop {
            match self.stream.read(dst) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => return r,
            }
        }
    }

    /// Reads exactly `dst.len()` body bytes.
    pub fn read_body_exact(&mut self, mut dst: &mut [u8]) -> io::Result<()> {
        while !dst.is_empty() {
            let n = self.read_body(dst)?;
            if n == 0 {
                return Err(truncated());
            }
            dst = &mut dst[n..];
        }
        Ok(())
    }

    /// Reads a whole (small) body into memory, at most `limit` bytes; more
    /// leaves the connection broken and is an error.
    pub fn read_body_to_vec(&mut self, head: &Head, limit: usize) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        match head.body {
            Body::Length(n) => {
                if n > limit as u64 {
                    return Err(invalid(format!("response body of {n} bytes, over {limit}")));
                }
                out.resize(n as usize, 0);
                self.read_body_exact(&mut out)?;
            }
            Body::Chunked => loop {
                let size = self.chunk_size_line()?;
                if size == 0 {
                    // Trailers, up to the empty line.
                    while !self.line()?.is_empty() {}
                    break;
                }
                if out.len() as u64 + size > limit as u64 {
                    return Err(invalid(format!("response body over {limit} bytes")));
                }
                let from = out.len();
                out.resize(from + size as usize, 0);
                self.read_body_exact(&mut out[from..])?;
                if !self.line()?.is_empty() {
                    return Err(invalid("chunk not followed by CRLF".into()));
                }
            },
            Body::Close => {
                let mut b = [0u8; 8192];
                loop {
                    let n = self.read_body(&mut b)?;
                    if n == 0 {
                        break;
                    }
                    if out.len() + n > limit {
                        return Err(invalid(format!("response body over {limit} bytes")));
                    }
                    out.extend_from_slice(&b[..n]);
                }
            }
        }
        self.finish(head);
        Ok(out)
    }

    /// The response has been read whole: the connection may carry another
    /// request unless the server said it closes it.
    pub fn finish(&mut self, head: &Head) {
        self.broken = head.close || head.body == Body::Close || self.at != self.end;
    }

    /// One CRLF-terminated line of a chunked body, without the CRLF.
    fn line(&mut self) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        let mut b = [0u8; 1];
        loop {
            if self.read_body(&mut b)? == 0 {
                return Err(truncated());
            }
            if b[0] == b'\n' {
                if out.last() == Some(&b'\r') {
                    out.pop();
                }
                return Ok(out);
            }
            if out.len() > 4096 {
                return Err(invalid("chunked body line too long".into()));
            }
            out.push(b[0]);
        }
    }

    fn chunk_size_line(&mut self) -> io::Result<u64> {
        let line = self.line()?;
        let hex = line.split(|&c| c == b';').next().unwrap_or(&[]);
        let s = std::str::from_utf8(hex).map_err(|_| invalid("bad chunk size".into()))?;
        u64::from_str_radix(s.trim(), 16).map_err(|_| invalid(format!("bad chunk size {s:?}")))
    }

    /// Cuts the connection both ways: a thread blocked reading it wakes.
    pub fn shutdown_fd(fd: i32) {
        // SAFETY: shutdown on a descriptor number; a stale number at worst
        // cuts a socket the caller also owns (the caller serializes this
        // against the owner closing it).
        unsafe {
            libc::shutdown(fd, libc::SHUT_RDWR);
        }
    }
}

fn parse_head(r: &httparse::Response<'_, '_>) -> io::Result<Head> {
    let status = r.code.ok_or_else(|| invalid("no status code".into()))?;
    let mut headers = Vec::with_capacity(r.headers.len());
    let mut length = None;
    let mut chunked = false;
    let mut close = r.version == Some(0);
    for h in r.headers.iter() {
        let name = h.name.to_ascii_lowercase();
        let value = String::from_utf8_lossy(h.value).trim().to_string();
        match name.as_str() {
            "content-length" => {
                let n: u64 = value
                    .parse()
                    .map_err(|_| invalid(format!("bad Content-Length {value:?}")))?;
                if length.is_some_and(|m| m != n) {
                    return Err(invalid("conflicting Content-Length headers".into()));
                }
                length = Some(n);
            }
            "transfer-encoding" => {
                chunked = value
                    .to_ascii_lowercase()
                    .split(',')
                    .any(|t| t.trim() == "chunked");
            }
            "connection" => {
                let v = value.to_ascii_lowercase();
                if v.split(',').any(|t| t.trim() == "close") {
                    close = true;
                }
            }
            _ => {}
        }
        headers.push((name, value));
    }
    let body = if status == 204 || status == 304 || (100..200).contains(&status) {
        Body::Length(0)
    } else if chunked {
        Body::Chunked
    } else if let Some(n) = length {
        Body::Length(n)
    } else {
        Body::Close
    };
    Ok(Head {
        status,
        headers,
        body,
        close,
    })
}

/// The body of a HEAD response is empty whatever Content-Length says.
pub fn head_of_head(mut h: Head) -> Head {
    h.body = Body::Length(0);
    h
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

pub fn truncated() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "the server closed the connection mid-body",
    )
}

/// A Content-Range header: `bytes START-END/TOTAL` (END inclusive), or
/// `bytes */TOTAL` (no range), or `bytes START-END/*` (no total).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContentRange {
    pub range: Option<(u64, u64)>,
    pub total: Option<u64>,
}

pub fn content_range(v: &str) -> Option<ContentRange> {
    let rest = v.trim().strip_prefix("bytes")?.trim_start();
    let (range, total) = rest.split_once('/')?;
    let total = if total.trim() == "*" {
        None
    } else {
        Some(total.trim().parse().ok()?)
    };
    if range.trim() == "*" {
        return Some(ContentRange { range: None, total });
    }
    let (a, b) = range.split_once('-')?;
    Some(ContentRange {
        range: Some((a.trim().parse().ok()?, b.trim().parse().ok()?)),
        total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_ranges() {
        let cr = |range, total| Some(ContentRange { range, total });
        assert_eq!(
            content_range("bytes 0-99/1000"),
            cr(Some((0, 99)), Some(1000))
        );
        assert_eq!(content_range("bytes */1000"), cr(None, Some(1000)));
        assert_eq!(content_range("bytes 5-9/*"), cr(Some((5, 9)), None));
        assert_eq!(content_range("items 0-1/2"), None);
    }

    /// A scripted server on a socket pair: heads split across reads, a
    /// chunked body with trailers, body bytes that arrive with the head.
    #[test]
    fn heads_bodies_and_chunked_encoding() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut req = [0u8; 4096];
            let _ = s.read(&mut req).unwrap();
            s.write_all(b"HTTP/1.1 206 Partial Content\r\nContent-Le")
                .unwrap();
            std::thread::sleep(Duration::from_millis(20));
            s.write_all(b"ngth: 10\r\nContent-Range: bytes 0-9/20\r\n\r\n0123456789")
                .unwrap();
            let _ = s.read(&mut req).unwrap();
            s.write_all(
                b"HTTP/1.1 503 Slow Down\r\nTransfer-Encoding: chunked\r\n\r\n5;x=y\r\nhello\r\n6\r\n world\r\n0\r\nX-T: 1\r\n\r\n",
            )
            .unwrap();
            let _ = s.read(&mut req).unwrap();
            s.write_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nrest")
                .unwrap();
        });
        let mut c = Conn::connect(
            &addr,
            0,
            (Duration::from_secs(5), Duration::from_secs(5)),
            None,
        )
        .unwrap();
        c.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"").unwrap();
        let h = c.read_head().unwrap();
        assert_eq!((h.status, h.body), (206, Body::Length(10)));
        let mut dst = [0u8; 10];
        c.read_body_exact(&mut dst).unwrap();
        assert_eq!(&dst, b"0123456789");
        c.finish(&h);
        assert!(c.reusable());
        c.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"").unwrap();
        let h = c.read_head().unwrap();
        assert_eq!((h.status, h.body), (503, Body::Chunked));
        assert_eq!(c.read_body_to_vec(&h, 1024).unwrap(), b"hello world");
        assert!(c.reusable());
        c.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"").unwrap();
        let h = c.read_head().unwrap();
        assert!(h.close);
        assert_eq!(c.read_body_to_vec(&h, 1024).unwrap(), b"rest");
        assert!(!c.reusable());
        server.join().unwrap();
    }
}
