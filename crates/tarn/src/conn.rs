//! One S3 client connection's socket, with what the server needs to survive
//! clients that stop reading or sending (issue 12):
//!
//! * a response-send idle timeout: a write that makes no progress for that
//!   long fails, which ends the connection and frees what the response held;
//! * an abort is a reset: a connection that ends in error (a response cut
//!   short by that timeout or by a failed read mid-body) is closed with
//!   `SO_LINGER` 0, so the client sees a reset, never a clean end of a
//!   truncated body;
//! * a normal close drains: after a response that was sent before the
//!   request's body was read (an early 403 or 503 with `Connection: close`),
//!   the server shuts its side, then reads and discards what the client still
//!   sends for a moment before closing. Closing with unread data would make
//!   the kernel send a reset, and the client could lose the answer.

use std::future::Future;
use std::io;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;

/// How long a closing connection keeps reading what the client still sends.
const DRAIN_MAX: Duration = Duration::from_secs(2);
/// How much a closing connection reads before giving up and resetting.
const DRAIN_MAX_BYTES: usize = 4 << 20;

/// What the request side tells the socket: the connection is being aborted.
#[derive(Debug, Default)]
pub struct ConnState {
    abort: AtomicBool,
}

impl ConnState {
    /// The connection ends in error: close it with a reset.
    pub fn abort(&self) {
        self.abort.store(true, Ordering::Relaxed);
    }

    fn aborted(&self) -> bool {
        self.abort.load(Ordering::Relaxed)
    }
}

pub struct ConnIo {
    stream: Option<TcpStream>,
    send_idle: Duration,
    /// The slowest a client may read what the server has to send, bytes/s
    /// on average over each window (the second) in which a write had to
    /// wait for it (0: no minimum), and the current window: its start,
    /// bytes written, and whether a write waited.
    min_rate: (u64, Duration),
    window: (std::time::Instant, u64, bool),
    /// Wakes a write that waits at the end of the window, so that a client
    /// reading too little to make the socket writable is judged too.
    window_end: Option<Pin<Box<Sleep>>>,
    /// Armed while a write waits for the client to make room.
    stalled: Option<Pin<Box<Sleep>>>,
    state: Arc<ConnState>,
}

impl ConnIo {
    pub fn new(
        stream: TcpStream,
        send_idle: Duration,
        min_rate: (u64, Duration),
        state: Arc<ConnState>,
    ) -> ConnIo {
        ConnIo {
            stream: Some(stream),
            send_idle,
            min_rate,
            window: (std::time::Instant::now(), 0, false),
            window_end: None,
            stalled: None,
            state,
        }
    }

    fn stream(&mut self) -> Pin<&mut TcpStream> {
        Pin::new(self.stream.as_mut().expect("stream"))
    }

    /// After a write returned Pending: Ready(error) once it has waited for
    /// the whole send idle timeout.
    fn poll_stalled(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let idle = self.send_idle;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.state.abort();
                Poll::Ready(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the client read nothing for {}s", idle.as_secs()),
                ))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn progressed<T>(
        &mut self,
        r: Poll<io::Result<T>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<T>> {
        match r {
            Poll::Ready(r) => {
                self.stalled = None;
                Poll::Ready(r)
            }
            Poll::Pending => match self.poll_stalled(cx) {
                Poll::Ready(e) => Poll::Ready(Err(e)),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl ConnIo {
    /// A write's outcome, counted against the minimum rate: a client that
    /// keeps the server waiting and reads less than the minimum over a
    /// window gets the connection reset (it would hold the response, and
    /// what it buffers, for as long as it likes by reading a byte now and
    /// then, inside the idle timeout).
    fn wrote(
        &mut self,
        r: Poll<io::Result<usize>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<usize>> {
        match &r {
            Poll::Ready(Ok(n)) => self.window.1 += *n as u64,
            Poll::Pending => self.window.2 = true,
            Poll::Ready(Err(_)) => {}
        }
        let (rate, window) = self.min_rate;
        if rate > 0 && self.window.0.elapsed() >= window {
            let (_, bytes, waited) = self.window;
            self.window = (std::time::Instant::now(), 0, false);
            if waited && (bytes as f64) < rate as f64 * window.as_secs_f64() {
                self.state.abort();
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "the client read {bytes} bytes in {}s, under the minimum of {rate} bytes/s",
                        window.as_secs_f64()
                    ),
                )));
            }
        }
        if rate > 0 && r.is_pending() {
            let end = tokio::time::Instant::from_std(self.window.0 + window);
            match &mut self.window_end {
                Some(t) if t.deadline() == end => {}
                t => *t = Some(Box::pin(tokio::time::sleep_until(end))),
            }
            if let Some(t) = self.window_end.as_mut() {
                // Registers this task to be woken at the window's end.
                let _ = t.as_mut().poll(cx);
            }
        }
        self.progressed(r, cx)
    }
}

impl ConnIo {
    /// Sends up to `len` bytes of `file` from `offset` when the socket has
    /// room. Ok(0) or an error: the caller writes those bytes from memory
    /// instead (an error of the socket's then comes back from that write).
    fn poll_sendfile(
        &mut self,
        cx: &mut Context<'_>,
        file: &std::os::fd::OwnedFd,
        offset: u64,
        len: usize,
    ) -> Poll<io::Result<usize>> {
        let stream = self.stream.as_ref().expect("stream");
        loop {
            if let Err(e) = std::task::ready!(stream.poll_write_ready(cx)) {
                return Poll::Ready(Err(e));
            }
            let sent = stream.try_io(tokio::io::Interest::WRITABLE, || {
                tarn_io::spans::sendfile(stream.as_raw_fd(), file, offset, len)
            });
            match sent {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                r => return Poll::Ready(r),
            }
        }
    }
}

impl AsyncRead for ConnIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.stream().poll_read(cx, buf)
    }
}

impl AsyncWrite for ConnIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        // Runs of GET data the store read from a shard file go from the
        // file (`tarn_io::spans`); the rest, and anything a sendfile cannot
        // send, from memory (which holds the same bytes). A view of a file
        // (`tarn_io::view`) is never read: what its sendfile cannot send
        // ends the response (the client sees a body cut short).
        let r = match tarn_io::spans::plan(bufs) {
            tarn_io::spans::Plan::File {
                fd,
                offset,
                len,
                view,
            } => match self.poll_sendfile(cx, &fd, offset, len) {
                Poll::Ready(Ok(n)) if n > 0 => {
                    tarn_io::spans::count(Some(n));
                    Poll::Ready(Ok(n))
                }
                Poll::Pending => Poll::Pending,
                Poll::Ready(r) => {
                    tarn_io::spans::count(None);
                    if view {
                        Poll::Ready(Err(r.err().unwrap_or_else(|| {
                            io::Error::new(
                                io::ErrorKind::UnexpectedEof,
                                "a shard file ended before the bytes verified in it",
                            )
                        })))
                    } else {
                        let front = tarn_io::spans::prefix(bufs, len);
                        self.stream().poll_write_vectored(cx, &front)
                    }
                }
            },
            tarn_io::spans::Plan::Memory(n) => {
                let front = tarn_io::spans::prefix(bufs, n);
                self.stream().poll_write_vectored(cx, &front)
            }
            tarn_io::spans::Plan::All => self.stream().poll_write_vectored(cx, bufs),
        };
        self.wrote(r, cx)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = self.stream().poll_flush(cx);
        self.progressed(r, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.stream().poll_shutdown(cx)
    }
}

impl Drop for ConnIo {
    fn drop(&mut self) {
        let Some(stream) = self.stream.take() else {
            return;
        };
        if self.state.aborted() {
            reset(stream);
            return;
        }
        // Drain on this thread's runtime; without one (shutting down), a
        // plain close.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(drain(stream));
        }
    }
}

/// Closes with a reset (RST) instead of a clean end (FIN).
fn reset(stream: TcpStream) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt on a socket we own, with a live struct of the
    // size we pass.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
    drop(stream);
}

/// Shuts the sending side, then reads and discards until the client closes,
/// a moment passes or too much arrives (then a reset).
async fn drain(mut stream: TcpStream) {
    // SAFETY: shutdown(2) of the write side of a socket we own.
    unsafe { libc::shutdown(stream.as_raw_fd(), libc::SHUT_WR) };
    let mut buf = vec![0u8; 64 << 10];
    let mut read = 0usize;
    let drained = tokio::time::timeout(DRAIN_MAX, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return true,
                Ok(n) => {
                    read += n;
                    if read > DRAIN_MAX_BYTES {
                        return false;
                    }
                }
            }
        }
    })
    .await;
    if drained != Ok(true) {
        reset(stream);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    async fn pair() -> (ConnIo, TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (s, _) = l.accept().await.unwrap();
        let io = ConnIo::new(
            s,
            Duration::from_secs(5),
            (0, Duration::from_secs(1)),
            Arc::default(),
        );
        (io, c)
    }

    /// Registered runs go from their files, the rest from memory, and a run
    /// the file cannot give (it is shorter) from memory too. The file here
    /// holds other bytes than the memory registered as its (the contract
    /// says they are the same), so that the client's bytes show which way
    /// each run went.
    #[tokio::test]
    async fn sends_registered_runs_from_their_files() {
        let dir = std::env::temp_dir().join(format!("tarn-conn-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("shard");
        std::fs::write(&path, b"FILE-0123456789").unwrap();
        let fd: Arc<std::os::fd::OwnedFd> = Arc::new(std::fs::File::open(&path).unwrap().into());
        let head = b"head|".to_vec();
        let body = b"mem--0123456789|past-the-end|tail".to_vec();
        let (sent0, fallbacks0) = tarn_io::spans::counters();
        // SAFETY: the vectors outlive the registrations and are not changed.
        let regs = unsafe {
            [
                tarn_io::spans::register(&body[..15], fd.clone(), 0).unwrap(),
                tarn_io::spans::register(&body[16..28], fd.clone(), 1000).unwrap(),
            ]
        };
        let (mut io, mut client) = pair().await;
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            tokio::io::AsyncReadExt::read_to_end(&mut client, &mut got)
                .await
                .unwrap();
            got
        });
        let mut bufs = [&head[..], &body[..]];
        while bufs.iter().any(|b| !b.is_empty()) {
            let slices: Vec<io::IoSlice<'_>> = bufs.iter().map(|b| io::IoSlice::new(b)).collect();
            let mut n = io.write_vectored(&slices).await.unwrap();
            for b in bufs.iter_mut() {
                let take = n.min(b.len());
                *b = &b[take..];
                n -= take;
            }
        }
        io.shutdown().await.unwrap();
        drop(io);
        let got = reader.await.unwrap();
        assert_eq!(got, b"head|FILE-0123456789|past-the-end|tail".to_vec());
        let (sent, fallbacks) = tarn_io::spans::counters();
        assert!(sent >= sent0 + 15, "{sent} {sent0}");
        assert!(fallbacks > fallbacks0);
        drop(regs);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A view is sent from its file or not at all: here the view lies past
    /// the file's end, so its sendfile sends nothing and the write fails.
    /// Reading the view's memory instead would raise SIGBUS (a mapping past
    /// the end of its file) and end this test binary.
    #[tokio::test]
    async fn a_view_its_file_cannot_send_ends_the_write() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard");
        std::fs::write(&path, b"FILE-0123456789").unwrap();
        let fd: Arc<std::os::fd::OwnedFd> = Arc::new(std::fs::File::open(&path).unwrap().into());
        let page = 4096;
        let view = tarn_io::view::View::map(&fd, 4 * page, 100).unwrap();
        let reg = tarn_io::spans::register_view(&view, fd.clone(), 4 * page).unwrap();
        let (mut io, mut client) = pair().await;
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let _ = tokio::io::AsyncReadExt::read_to_end(&mut client, &mut got).await;
            got
        });
        io.write_all(b"head|").await.unwrap();
        let e = io.write_all(view.as_ref()).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
        drop(io);
        assert_eq!(reader.await.unwrap(), b"head|".to_vec());
        drop(reg);
        drop(view);
    }
}
