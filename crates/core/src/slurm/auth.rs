//! How a slurmstepd and the side that admits it (srun's collective root, or its parent stepd in the tree)
//! prove to each other that they serve the same step, without the step's secret ever crossing the network
//! after launch.
//!
//! srun draws a 32-byte secret per step and hands it to the stepds in the launch environment (Slurm's own
//! launch request). On each collective connection both sides then prove they hold the secret with an
//! HMAC-SHA256 over a nonce from each side, the joining node and the admitting side (`to`: srun's root, or
//! the parent's node index):
//!
//! ```text
//! joining stepd                                   srun's root or the parent stepd
//!   HELLO   node, nonce_j, ...            ->
//!                                         <-      CHALLENGE nonce_a
//!   PROOF   HMAC(secret, "rpmi join" | node | to | nonce_j | nonce_a)   ->   checked
//!                                         <-      WELCOME HMAC(secret, "rpmi admit" | node | to | nonce_j | nonce_a)
//!   checked: the peer holds the step's secret
//! ```
//!
//! The two proofs carry different labels, so neither side's answer can be replayed as the other's; `to`
//! keeps a proof made for one link from passing on another; fresh nonces on both sides mean no recorded
//! proof is ever accepted again. An eavesdropper learns the node indexes and two MACs, not the secret.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;

/// Bytes of the per-step secret, of each nonce and of each proof.
pub const SECRET_LEN: usize = 32;
pub const NONCE_LEN: usize = 32;
pub const PROOF_LEN: usize = 32;

pub type Nonce = [u8; NONCE_LEN];
pub type Proof = [u8; PROOF_LEN];

/// Who proves: the labels keep a joining stepd's proof from passing as the admitting side's and the other way
/// round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prover {
    /// The stepd that connects.
    Joiner,
    /// srun's root or a parent stepd, which accepts the connection.
    Acceptor,
}

impl Prover {
    fn label(self) -> &'static [u8] {
        match self {
            Prover::Joiner => b"rpmi join",
            Prover::Acceptor => b"rpmi admit",
        }
    }
}

/// The admitting side in a [`Transcript`] when it is srun's root (a parent stepd is its node index).
pub const ROOT: u32 = u32::MAX;

/// What one handshake proves knowledge of the secret over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transcript {
    /// The joining node.
    pub node: u32,
    /// Who admits it: [`ROOT`], or its parent's node index.
    pub to: u32,
    pub joiner_nonce: Nonce,
    pub acceptor_nonce: Nonce,
}

/// The per-step secret: random bytes, passed to the stepds in hex.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret([u8; SECRET_LEN]);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// The secret of these bytes: random ones, from the kernel's source (the host draws them).
    pub fn new(bytes: [u8; SECRET_LEN]) -> Secret {
        Secret(bytes)
    }

    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(text: &str) -> Option<Secret> {
        let t = text.as_bytes();
        if t.len() != 2 * SECRET_LEN {
            return None;
        }
        let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
        let mut b = [0u8; SECRET_LEN];
        for (i, out) in b.iter_mut().enumerate() {
            *out = digit(t[2 * i])? << 4 | digit(t[2 * i + 1])?;
        }
        Some(Secret(b))
    }

    fn mac(&self, role: Prover, t: &Transcript) -> Hmac<Sha256> {
        // HMAC takes a key of any length; 32 bytes is never refused.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).unwrap_or_else(|_| unreachable!());
        mac.update(role.label());
        mac.update(&t.node.to_be_bytes());
        mac.update(&t.to.to_be_bytes());
        mac.update(&t.joiner_nonce);
        mac.update(&t.acceptor_nonce);
        mac
    }

    /// A short name of this step's instance, the same in every stepd, that tells nothing of the secret
    /// (8 hex digits of a MAC of a fixed label).
    pub fn instance_tag(&self) -> String {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).unwrap_or_else(|_| unreachable!());
        mac.update(b"rpmi step instance");
        mac.finalize().into_bytes()[..4].iter().map(|b| format!("{b:02x}")).collect()
    }

    /// `role`'s proof over `t`.
    pub fn prove(&self, role: Prover, t: &Transcript) -> Proof {
        self.mac(role, t).finalize().into_bytes().into()
    }

    /// Whether `proof` is `role`'s proof over `t` (compared in constant time).
    pub fn verify(&self, role: Prover, t: &Transcript, proof: &Proof) -> bool {
        self.mac(role, t).verify_slice(proof).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A secret or nonce of its own for each `n`.
    fn bytes(n: u8) -> [u8; 32] {
        std::array::from_fn(|i| n.wrapping_mul(31).wrapping_add(i as u8))
    }

    fn transcript() -> Transcript {
        Transcript { node: 3, to: ROOT, joiner_nonce: bytes(1), acceptor_nonce: bytes(2) }
    }

    #[test]
    fn a_proof_checks_only_for_its_secret_role_and_transcript() {
        let (s, t) = (Secret::new(bytes(3)), transcript());
        let p = s.prove(Prover::Joiner, &t);
        assert!(s.verify(Prover::Joiner, &t, &p));
        assert!(!s.verify(Prover::Acceptor, &t, &p), "a joiner's proof must not pass as the acceptor's");
        assert!(!Secret::new(bytes(4)).verify(Prover::Joiner, &t, &p));
        for changed in [
            Transcript { node: 4, ..t },
            Transcript { to: 0, ..t },
            Transcript { joiner_nonce: bytes(5), ..t },
            Transcript { acceptor_nonce: bytes(6), ..t },
        ] {
            assert!(!s.verify(Prover::Joiner, &changed, &p));
        }
        let mut bad = p;
        bad[31] ^= 1;
        assert!(!s.verify(Prover::Joiner, &t, &bad));
        // The proof is not the secret, nor does it contain it.
        assert!(!p.windows(8).any(|w| s.0.windows(8).any(|x| x == w)));
    }

    #[test]
    fn secrets_travel_in_hex_and_never_print() {
        let s = Secret::new(bytes(7));
        let hex = s.to_hex();
        assert_eq!(hex.len(), 64);
        assert_eq!(Secret::from_hex(&hex), Some(s.clone()));
        assert_eq!(Secret::from_hex("zz"), None);
        assert_eq!(Secret::from_hex(&"g".repeat(64)), None);
        assert!(!format!("{s:?}").contains(&hex[..8]));
    }

    #[test]
    fn instance_tags_differ_between_secrets_and_are_short() {
        let (a, b) = (Secret::new(bytes(8)), Secret::new(bytes(9)));
        assert_eq!(a.instance_tag(), a.clone().instance_tag());
        assert_ne!(a.instance_tag(), b.instance_tag());
        assert_eq!(a.instance_tag().len(), 8);
    }

    #[test]
    fn hmac_sha256_is_the_standard_one() {
        // RFC 4231, test case 2.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(b"Jefe").unwrap();
        mac.update(b"what do ya want for nothing?");
        let hex: String = mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    }
}
