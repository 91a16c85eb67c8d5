//! A slurmstepd's connection to srun's collective root: connecting, the handshake of [`super::auth`], and
//! sends that cannot hold the stepd for ever.
//!
//! A connection the root closes before it has admitted the node (its table of connections still in the
//! handshake was full, say, because a whole step's nodes connected at once, or someone else's connections
//! filled it) is retried with growing pauses for a bounded time. A root whose own proof is wrong is not
//! srun's: the stepd gives up at once.

use super::auth::{self, Role, Secret, Transcript};
use super::wire::{FromRoot, ToRoot, CONTROL_MAX};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// How long one connection attempt may take to connect, and each handshake step to be answered.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);
/// The first pause before a retry; it doubles up to [`PAUSE_MAX`].
const PAUSE_FIRST: Duration = Duration::from_millis(20);
const PAUSE_MAX: Duration = Duration::from_secs(1);
/// Every send may take this long, plus a second per [`SEND_RATE_MIN`] bytes, however the peer reads.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);
const SEND_RATE_MIN: usize = 1 << 20;

/// Why joining the root failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JoinError {
    /// Every attempt until the deadline failed; the last one for this reason.
    GaveUp { attempts: u32, last: String },
    /// Something answered on the port that does not hold the step's secret.
    NotTheRoot(String),
}

impl std::fmt::Display for JoinError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JoinError::GaveUp { attempts, last } => {
                write!(f, "cannot join srun's collective root after {attempts} attempts: {last}")
            }
            JoinError::NotTheRoot(why) => {
                write!(f, "the process on srun's collective port is not this step's srun: {why}")
            }
        }
    }
}

/// Connects to the root at one of `addrs` as node `node` and completes the handshake, retrying until
/// `patience` has passed.
pub fn join(addrs: &[SocketAddr], node: u32, secret: &Secret, patience: Duration) -> Result<TcpStream, JoinError> {
    let deadline = Instant::now() + patience;
    let mut pause = PAUSE_FIRST;
    let mut attempts = 0;
    loop {
        attempts += 1;
        let mut last = String::from("no address");
        for addr in addrs {
            match attempt(addr, node, secret, deadline) {
                Ok(s) => return Ok(s),
                Err(Attempt::Impostor(why)) => return Err(JoinError::NotTheRoot(format!("{addr}: {why}"))),
                Err(Attempt::Failed(why)) => last = format!("{addr}: {why}"),
            }
        }
        if Instant::now() + pause > deadline {
            return Err(JoinError::GaveUp { attempts, last });
        }
        std::thread::sleep(jitter(pause));
        pause = (pause * 2).min(PAUSE_MAX);
    }
}

/// Spreads retries of many nodes over the pause (a quarter either way), so they do not come back at once.
fn jitter(pause: Duration) -> Duration {
    let r = auth::nonce().map_or(0, |n| u32::from_ne_bytes([n[0], n[1], n[2], n[3]]));
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
fn attempt(addr: &SocketAddr, node: u32, secret: &Secret, deadline: Instant) -> Result<TcpStream, Attempt> {
    let left = deadline.saturating_duration_since(Instant::now()).clamp(Duration::from_millis(1), STEP_TIMEOUT);
    let mut s = TcpStream::connect_timeout(addr, left).map_err(failed)?;
    let _ = s.set_nodelay(true);
    let stepd_nonce = auth::nonce().map_err(failed)?;
    send(&mut s, &encode(&ToRoot::Hello { node, nonce: stepd_nonce })).map_err(failed)?;
    let root_nonce = match receive(&mut s, deadline)? {
        FromRoot::Challenge { nonce } => nonce,
        other => return Err(Attempt::Impostor(format!("it answered HELLO with {other:?}"))),
    };
    let t = Transcript { node, stepd_nonce, root_nonce };
    send(&mut s, &encode(&ToRoot::Proof { proof: secret.prove(Role::Stepd, &t) })).map_err(failed)?;
    match receive(&mut s, deadline)? {
        FromRoot::Welcome { proof } if secret.verify(Role::Root, &t, &proof) => {}
        FromRoot::Welcome { .. } => return Err(Attempt::Impostor("its proof of the step's secret is wrong".into())),
        other => return Err(Attempt::Impostor(format!("it answered PROOF with {other:?}"))),
    }
    s.set_read_timeout(None).map_err(failed)?;
    Ok(s)
}

fn encode(m: &ToRoot) -> Vec<u8> {
    // Handshake frames are a few dozen bytes.
    m.encode().unwrap_or_default()
}

/// One handshake frame from the root, by `deadline`; a close or a reset is worth a retry (the root drops
/// connections it has no room for), anything undecodable is not the root.
fn receive(s: &mut TcpStream, deadline: Instant) -> Result<FromRoot, Attempt> {
    let mut len = [0u8; 4];
    read_by(s, &mut len, deadline).map_err(failed)?;
    let len = u32::from_be_bytes(len) as usize;
    if len > CONTROL_MAX {
        return Err(Attempt::Impostor(format!("it sent a frame of {len} bytes during the handshake")));
    }
    let mut payload = vec![0; len];
    read_by(s, &mut payload, deadline).map_err(failed)?;
    FromRoot::decode(&payload).map_err(|e| Attempt::Impostor(e.to_string()))
}

/// Fills `buf` by `deadline`: a peer that trickles bytes cannot stretch the wait, since each read gets only
/// what is left of it.
fn read_by(s: &mut TcpStream, mut buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    while !buf.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now()).min(STEP_TIMEOUT);
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "no handshake from srun in time"));
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
pub fn send(s: &mut TcpStream, frame: &[u8]) -> io::Result<()> {
    let deadline = Instant::now() + SEND_TIMEOUT + Duration::from_secs((frame.len() / SEND_RATE_MIN) as u64);
    send_by(s, frame, deadline)
}

fn send_by(s: &mut TcpStream, frame: &[u8], deadline: Instant) -> io::Result<()> {
    let mut rest = frame;
    while !rest.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "srun takes what is sent too slowly"));
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
            let mut hello = [0u8; 4 + crate::slurm::wire::HELLO_LEN];
            c.read_exact(&mut hello).unwrap();
            c.write_all(&FromRoot::Challenge { nonce: [1; 32] }.encode().unwrap()).unwrap();
            let mut proof = [0u8; 4 + crate::slurm::wire::PROOF_LEN_ON_WIRE];
            c.read_exact(&mut proof).unwrap();
            c.write_all(&FromRoot::Welcome { proof: [0; 32] }.encode().unwrap()).unwrap();
        });
        let err = join(&[addr], 0, &Secret::generate().unwrap(), Duration::from_secs(30)).unwrap_err();
        assert!(matches!(err, JoinError::NotTheRoot(_)), "{err}");
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
        let err = join(&[addr], 0, &Secret::generate().unwrap(), Duration::from_secs(1)).unwrap_err();
        // Well under the 10 s the trickle takes: the deadline bounds the handshake, not each read.
        assert!(start.elapsed() < Duration::from_secs(5), "{err} after {:?}", start.elapsed());
        trickle.join().unwrap();
    }

    #[test]
    fn nobody_listening_is_retried_until_the_deadline() {
        let addr = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let err = join(&[addr], 0, &Secret::generate().unwrap(), Duration::from_millis(300)).unwrap_err();
        let JoinError::GaveUp { attempts, .. } = err else { panic!("{err}") };
        assert!(attempts > 1, "{attempts} attempts");
    }
}
