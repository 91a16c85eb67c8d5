//! The joining side of the collective's handshake ([`super::auth`]): a slurmstepd connecting to srun's root,
//! or to its parent in the tree, and sends that cannot hold the stepd for ever. It runs in prefork, before
//! any task exists, so it may block (within its bounds).
//!
//! A connection the acceptor closes before it has admitted the node (its table of connections still in the
//! handshake was full, say, because a whole step's nodes connected at once, or someone else's connections
//! filled it), or that is refused (the parent's listener is not up yet), is retried with growing pauses for
//! a bounded time. An acceptor whose own proof is wrong does not hold the step's secret: the stepd gives up
//! at once.

use super::auth::{Prover, Secret, Transcript};
use super::protocol::{Down, Up, CONTROL_MAX};
use crate::collective::Allgather;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// How long one connection attempt may take to connect, and each handshake step to be answered.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);
/// The first pause before a retry; it doubles up to [`PAUSE_MAX`].
const PAUSE_FIRST: Duration = Duration::from_millis(20);
const PAUSE_MAX: Duration = Duration::from_secs(1);
/// Every send may take this long, plus a second per [`SEND_RATE_MIN`] bytes, however the peer reads.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);
const SEND_RATE_MIN: usize = 1 << 20;

/// What a joining stepd says in its HELLO.
#[derive(Debug, Clone, Copy)]
pub struct Hello {
    pub node: u32,
    /// Whom it joins: [`auth::ROOT`], or a lower peer's node index.
    pub to: u32,
    /// Where it listens for its higher peers (0: it has none).
    pub port: u16,
    /// The tree's width it builds the tree with.
    pub width: u32,
    /// How its exchanges go.
    pub allgather: Allgather,
}

/// Why joining failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JoinError {
    /// Every attempt until the deadline failed; the last one for this reason.
    GaveUp { whom: String, attempts: u32, last: String },
    /// Something answered that does not hold the step's secret.
    Impostor { whom: String, why: String },
    /// The pause between attempts said to stop trying, and why.
    Abandoned(String),
}

impl std::fmt::Display for JoinError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JoinError::GaveUp { whom, attempts, last } => {
                write!(f, "cannot join {whom} after {attempts} attempts: {last}")
            }
            JoinError::Impostor { whom, why } => {
                write!(f, "what answered as {whom} does not hold the step's secret: {why}")
            }
            JoinError::Abandoned(why) => f.write_str(why),
        }
    }
}

/// Connects to one of `addrs` (`whom`, for messages) and completes the handshake as `hello` says, retrying
/// until `patience` has passed. Between attempts it calls `pause` with how long to wait; an error from it
/// stops the trying.
pub fn join(
    addrs: &[SocketAddr],
    hello: &Hello,
    secret: &Secret,
    patience: Duration,
    whom: &str,
    mut pause: impl FnMut(Duration) -> Result<(), String>,
) -> Result<TcpStream, JoinError> {
    let deadline = Instant::now() + patience;
    let mut wait = PAUSE_FIRST;
    let mut attempts = 0;
    loop {
        attempts += 1;
        let mut last = String::from("no address");
        for addr in addrs {
            match attempt(addr, hello, secret, deadline) {
                Ok(s) => return Ok(s),
                Err(Attempt::Impostor(why)) => {
                    return Err(JoinError::Impostor { whom: whom.into(), why: format!("{addr}: {why}") })
                }
                Err(Attempt::Failed(why)) => last = format!("{addr}: {why}"),
            }
        }
        if Instant::now() + wait > deadline {
            return Err(JoinError::GaveUp { whom: whom.into(), attempts, last });
        }
        pause(jitter(wait)).map_err(JoinError::Abandoned)?;
        wait = (wait * 2).min(PAUSE_MAX);
    }
}

/// The pause of [`join`] that only waits.
pub fn sleep(d: Duration) -> Result<(), String> {
    std::thread::sleep(d);
    Ok(())
}

/// Spreads retries of many nodes over the pause (a quarter either way), so they do not come back at once.
fn jitter(pause: Duration) -> Duration {
    let r = crate::slurm::random::nonce().map_or(0, |n| u32::from_ne_bytes([n[0], n[1], n[2], n[3]]));
    let quarter = pause / 4;
    pause - quarter + quarter.mul_f64(2.0 * f64::from(r) / f64::from(u32::MAX))
}

enum Attempt {
    /// Worth retrying: refused, closed, reset, timed out.
    Failed(String),
    /// The peer answered but cannot prove it holds the secret.
    Impostor(String),
}

fn failed(e: io::Error) -> Attempt {
    Attempt::Failed(e.to_string())
}

/// One connection and handshake, all of it by `deadline` (whatever the peer sends, and however slowly).
fn attempt(addr: &SocketAddr, hello: &Hello, secret: &Secret, deadline: Instant) -> Result<TcpStream, Attempt> {
    let left = deadline.saturating_duration_since(Instant::now()).clamp(Duration::from_millis(1), STEP_TIMEOUT);
    let mut s = TcpStream::connect_timeout(addr, left).map_err(failed)?;
    let _ = s.set_nodelay(true);
    let joiner_nonce = crate::slurm::random::nonce().map_err(failed)?;
    let Hello { node, to, port, width, allgather } = *hello;
    send(&mut s, &encode(&Up::Hello { node, nonce: joiner_nonce, port, width, allgather })).map_err(failed)?;
    let acceptor_nonce = match receive(&mut s, deadline).map_err(read_failed)? {
        Down::Challenge { nonce } => nonce,
        other => return Err(Attempt::Impostor(format!("it answered HELLO with {}", other.name()))),
    };
    let t = Transcript { node, to, joiner_nonce, acceptor_nonce };
    send(&mut s, &encode(&Up::Proof { proof: secret.prove(Prover::Joiner, &t) })).map_err(failed)?;
    match receive(&mut s, deadline).map_err(read_failed)? {
        Down::Welcome { proof } if secret.verify(Prover::Acceptor, &t, &proof) => {}
        Down::Welcome { .. } => return Err(Attempt::Impostor("its proof of the step's secret is wrong".into())),
        other => return Err(Attempt::Impostor(format!("it answered PROOF with {}", other.name()))),
    }
    s.set_read_timeout(None).map_err(failed)?;
    Ok(s)
}

fn encode(m: &Up) -> Vec<u8> {
    // Handshake frames are a few dozen bytes.
    m.encode().unwrap_or_default()
}

/// Why a control frame could not be read.
enum ReadError {
    /// A close, a reset, a timeout: worth a retry (an acceptor drops connections it has no room for).
    Io(io::Error),
    /// Not a frame of this protocol.
    Garbage(String),
}

fn read_failed(e: ReadError) -> Attempt {
    match e {
        ReadError::Io(e) => failed(e),
        ReadError::Garbage(why) => Attempt::Impostor(why),
    }
}

/// One control frame from the acceptor, by `deadline`.
fn receive(s: &mut TcpStream, deadline: Instant) -> Result<Down, ReadError> {
    let mut len = [0u8; 4];
    read_by(s, &mut len, deadline).map_err(ReadError::Io)?;
    let len = u32::from_be_bytes(len) as usize;
    if len > CONTROL_MAX {
        return Err(ReadError::Garbage(format!("it sent a frame of {len} bytes where a control frame was due")));
    }
    let mut payload = vec![0; len];
    read_by(s, &mut payload, deadline).map_err(ReadError::Io)?;
    Down::decode(&payload).map_err(|e| ReadError::Garbage(e.to_string()))
}

/// The next control frame srun sends on the stepd's connection to it, if one comes within `wait`: what it says
/// about the stepd's lower peers (PEER, PEER_DONE), or END. A frame whose first byte has come is read whole,
/// within [`STEP_TIMEOUT`].
pub fn notice(s: &mut TcpStream, wait: Duration) -> Result<Option<Down>, String> {
    let mut pfd = libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one live pollfd.
    let n = unsafe { libc::poll(&mut pfd, 1, wait.as_millis().min(i32::MAX as u128) as i32) };
    if n <= 0 {
        return Ok(None);
    }
    match receive(s, Instant::now() + STEP_TIMEOUT) {
        Ok(m) => Ok(Some(m)),
        Err(ReadError::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof => Err("srun closed the connection".into()),
        Err(ReadError::Io(e)) => Err(format!("the connection to srun failed: {e}")),
        Err(ReadError::Garbage(why)) => Err(format!("srun sent {why}")),
    }
}

/// Fills `buf` by `deadline`: a peer that trickles bytes cannot stretch the wait, since each read gets only
/// what is left of it.
fn read_by(s: &mut TcpStream, mut buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    while !buf.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now()).min(STEP_TIMEOUT);
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "no handshake in time"));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(buf) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes all of `frame`, giving up once it has taken longer than its size allows: a peer that reads a byte
/// at a time cannot hold the stepd, since each partial write does not restart the clock.
fn send(s: &mut TcpStream, frame: &[u8]) -> io::Result<()> {
    let deadline = Instant::now() + SEND_TIMEOUT + Duration::from_secs((frame.len() / SEND_RATE_MIN) as u64);
    send_by(s, frame, deadline)
}

fn send_by(s: &mut TcpStream, frame: &[u8], deadline: Instant) -> io::Result<()> {
    let mut rest = frame;
    while !rest.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the peer takes what is sent too slowly"));
        }
        s.set_write_timeout(Some(left))?;
        match s.write(rest) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => rest = &rest[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    const HELLO: Hello = Hello { node: 0, to: super::super::auth::ROOT, port: 0, width: 1, allgather: Allgather::Tree };

    #[test]
    fn a_slow_reader_cannot_hold_a_send_past_its_deadline() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (peer, _) = l.accept().unwrap();
        // The peer reads a little now and then: the send must fail at its deadline, not go on for ever.
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reading = done.clone();
        let reader = std::thread::spawn(move || {
            let mut peer = peer;
            let mut b = [0u8; 1];
            while !reading.load(std::sync::atomic::Ordering::SeqCst) && peer.read(&mut b).is_ok_and(|n| n > 0) {
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        let err = send_by(&mut s, &vec![0u8; 64 << 20], Instant::now() + Duration::from_millis(500)).unwrap_err();
        assert!(matches!(err.kind(), io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock), "{err}");
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        reader.join().unwrap();
    }

    #[test]
    fn an_impostor_is_not_retried() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let fake = std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            let mut hello = [0u8; 4 + crate::slurm::protocol::HELLO_LEN];
            c.read_exact(&mut hello).unwrap();
            c.write_all(&Down::Challenge { nonce: [1; 32] }.encode().unwrap()).unwrap();
            let mut proof = [0u8; 4 + crate::slurm::protocol::PROOF_LEN_ON_WIRE];
            c.read_exact(&mut proof).unwrap();
            c.write_all(&Down::Welcome { proof: [0; 32] }.encode().unwrap()).unwrap();
        });
        let err =
            join(&[addr], &HELLO, &crate::slurm::random::secret().unwrap(), Duration::from_secs(30), "srun", sleep);
        assert!(matches!(err, Err(JoinError::Impostor { .. })), "{err:?}");
        fake.join().unwrap();
    }

    #[test]
    fn a_peer_that_trickles_bytes_cannot_stretch_the_deadline() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let trickle = std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            // A frame length announcing a whole control frame, then a byte every 200 ms.
            let _ = c.write_all(&(CONTROL_MAX as u32).to_be_bytes());
            for _ in 0..50 {
                std::thread::sleep(Duration::from_millis(200));
                if c.write_all(&[0]).is_err() {
                    break;
                }
            }
        });
        let start = Instant::now();
        let err =
            join(&[addr], &HELLO, &crate::slurm::random::secret().unwrap(), Duration::from_secs(1), "srun", sleep)
                .unwrap_err();
        // Well under the 10 s the trickle takes: the deadline bounds the handshake, not each read.
        assert!(start.elapsed() < Duration::from_secs(5), "{err} after {:?}", start.elapsed());
        trickle.join().unwrap();
    }

    #[test]
    fn nobody_listening_is_retried_until_the_deadline() {
        let addr = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let err =
            join(&[addr], &HELLO, &crate::slurm::random::secret().unwrap(), Duration::from_millis(300), "srun", sleep);
        let Err(JoinError::GaveUp { attempts, .. }) = err else { panic!("{err:?}") };
        assert!(attempts > 1, "{attempts} attempts");
    }

    #[test]
    fn the_pause_can_stop_the_trying() {
        let addr = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let mut pauses = 0;
        let err =
            join(&[addr], &HELLO, &crate::slurm::random::secret().unwrap(), Duration::from_secs(30), "n2", |_| {
                pauses += 1;
                if pauses == 3 {
                    return Err("the parent is done".into());
                }
                Ok(())
            });
        assert_eq!(err.unwrap_err(), JoinError::Abandoned("the parent is done".into()));
    }

    #[test]
    fn a_notice_is_read_whole_and_silence_is_none() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut srun, _) = l.accept().unwrap();
        assert_eq!(notice(&mut s, Duration::from_millis(10)), Ok(None));
        let parent = Down::Peer { node: 0, port: 7 }.encode().unwrap();
        srun.write_all(&parent[..3]).unwrap();
        let rest = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            srun.write_all(&parent[3..]).unwrap();
            srun
        });
        assert_eq!(notice(&mut s, Duration::from_secs(5)), Ok(Some(Down::Peer { node: 0, port: 7 })));
        drop(rest.join().unwrap());
        assert_eq!(notice(&mut s, Duration::from_secs(5)), Err("srun closed the connection".into()));
    }
}
