//! Descriptors over the shared-memory transport's Unix socket (SCM_RIGHTS):
//! the daemon sends the arena and the mailbox with its AUTH reply, the client
//! sends its put window with AUTH. Client and server both use these two calls.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

/// Most descriptors one KV message carries (arena + mailbox, or a put
/// window).
pub const FDS_PER_MESSAGE_MAX: usize = 4;
/// Most descriptors one message of any protocol here carries (a local-read
/// grant, `local::FDS_MAX`); more than this arriving are closed by the
/// kernel, and the receive fails (MSG_CTRUNC).
pub const FDS_MAX: usize = 64;
/// Room for `FDS_MAX` descriptors' control message, 8-byte aligned as cmsg
/// needs (CMSG_SPACE(64 × 4) = 272 bytes on Linux).
const CMSG_WORDS: usize = 40;

/// Sends `data` with `fds` attached to its first byte. Returns the bytes sent
/// (the descriptors travel with the first call that sends anything).
pub fn send(sock: i32, data: &[u8], fds: &[i32]) -> io::Result<usize> {
    assert!(fds.len() <= FDS_MAX, "too many descriptors");
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let mut cmsg_buf = [0u64; CMSG_WORDS];
    // SAFETY: msghdr built over live buffers; CMSG macros stay inside cmsg_buf.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if !fds.is_empty() {
            let bytes = std::mem::size_of_val(fds) as u32;
            msg.msg_control = cmsg_buf.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(bytes) as usize;
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(bytes) as usize;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(c),
                bytes as usize,
            );
        }
        let n = libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL);
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }
}

/// Receives bytes into `buf` and any descriptors attached to them, owned at
/// once so that those the caller does not use are closed.
pub fn recv(sock: i32, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cmsg_buf = [0u64; CMSG_WORDS];
    // SAFETY: msghdr over live buffers; CMSG macros stay inside cmsg_buf.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cmsg_buf.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&cmsg_buf);
        let n = libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC);
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut fds = Vec::new();
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c);
                let count = ((*c).cmsg_len - libc::CMSG_LEN(0) as usize) / 4;
                for i in 0..count {
                    let raw = std::ptr::read_unaligned(data.add(i * 4).cast::<i32>());
                    fds.push(OwnedFd::from_raw_fd(raw));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "more descriptors arrived than a message may carry",
            ));
        }
        Ok((n as usize, fds))
    }
}
