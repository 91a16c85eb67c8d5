//! The image of the node's key-value space after a fence (revision 2 of rpmi's additions to the wire, laid out
//! by `rpmi_wire::image`), for rpmi's client libraries to answer gets from without a round trip. Made at the
//! first request after a fence, at most once per fence, and only while the store is as the fence left it
//! (later, the request is refused and the task reads the wire); handed to the host
//! ([`Server::write_kvs_image`]), which writes it straight into one sealed memory file for the node and sends
//! that file with each task's answer ([`Server::attached`]). The server keeps no copy: the file is
//! the only one, bounded as the store is (its keys and values, and 16 bytes an entry), and while it is written
//! the server holds the entries' order (32 bytes an entry) beside it.
//!
//! A task may keep every image's file open, and with it the image's memory, which its host wrote and which
//! no job may be charged for: so the images one server makes add up to the store's bound at most (beyond,
//! the request is refused and tasks read the wire), each charged as the memory it takes ([`IMAGE_CHARGE`]),
//! and a fence that brought nothing new keeps the image of the one before rather than making another.

use super::{Attached, Protocol, Server};
use crate::server::effect::TaskId;
use crate::wire::image;
use crate::wire::pmi2::Writer;
use crate::wire::response::{rc, Line};

/// What an image costs beside its bytes: its memory file takes whole pages (4 KiB at least), and the kernel's
/// file for it about one more. An image of a few bytes is charged that, so that many small ones cannot pin
/// more than the store's bound.
const IMAGE_CHARGE: usize = 4096;

/// The memory an image of `len` bytes is charged: its pages, and one for its file.
fn charge(len: usize) -> usize {
    len.div_ceil(IMAGE_CHARGE).saturating_add(1).saturating_mul(IMAGE_CHARGE)
}

#[derive(Default)]
pub(super) struct Images {
    /// Full barriers completed.
    fences: u64,
    /// The store changed since the last fence: no image of it can be made.
    changed: bool,
    /// The image of the store as the last fence left it, once asked for: the fence it was made after (an
    /// earlier one, where the fences since brought nothing), and its length.
    current: Option<(u64, usize)>,
    /// The images made so far, as charged ([`charge`]): at most the store's bound.
    made: usize,
    /// The length an image of the store as fence N left it takes, once measured: a request refused for
    /// the bound is refused again without going over the store.
    measured: Option<(u64, usize)>,
    /// That image is for the host to write.
    due: bool,
}

impl Server {
    /// A full barrier completed: the store is as the fence leaves it, and its image is made when first asked
    /// for; where the store did not change since the last image, that image stands for this fence too.
    pub(super) fn fence_done(&mut self) {
        let images = &mut self.images;
        images.fences += 1;
        if std::mem::take(&mut images.changed) {
            images.current = None;
            images.due = false;
        }
    }

    /// The store changed since the last fence: what that fence left can no longer be imaged.
    pub(super) fn store_changed(&mut self) {
        self.images.changed = true;
    }

    /// The fence whose image the host is to write now ([`Server::write_kvs_image`]): asked for, not written.
    pub fn kvs_image_due(&self) -> Option<u64> {
        self.images.current.filter(|_| self.images.due).map(|(fence, _)| fence)
    }

    /// Writes the image [`Server::kvs_image_due`] names to `out` (the node's memory file, which the host then
    /// seals and sends with the answers [`Server::attached`] names); it is due no more.
    pub fn write_kvs_image(&mut self, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        self.images.due = false;
        // The fence it was made after: a later one that brought nothing keeps it.
        let fence = self.images.current.map_or(self.images.fences, |(fence, _)| fence);
        image::write(out, fence, self.kvs.entries())
    }

    /// `get_kvs_image` (PMI-2's `kvs-image`): the answer names the image's length and fence, and the memory
    /// file goes with its first byte. Refused where there is no image of the last fence, where the images made
    /// would go over the store's bound, or where other answers are queued before this one (rpmi's libraries
    /// ask with nothing else outstanding).
    pub(super) fn send_kvs_image(&mut self, task: TaskId) {
        let c = &self.clients[task];
        let pending = !c.out.is_empty() || c.shared.is_some();
        let budget = self.limits.kvs_bytes_max;
        let images = &mut self.images;
        let sent = match images.current {
            _ if pending => Err("answers to other requests are queued before it"),
            Some(image) => Ok(image),
            None if images.fences == 0 => Err("no fence yet"),
            None if images.changed => Err("the key-value space changed since the last fence"),
            None => {
                let measured = images.measured.filter(|&(fence, _)| fence == images.fences);
                let len = measured.map_or_else(|| image::len_of(self.kvs.entries()), |(_, len)| len);
                images.measured = Some((images.fences, len));
                match len {
                    len if u32::try_from(len).is_err() => Err("the key-value space is too large for an image"),
                    len if images.made.saturating_add(charge(len)) > budget => {
                        Err("the images of the key-value space this server made reached its store's bound")
                    }
                    len => {
                        images.made += charge(len);
                        images.current = Some((images.fences, len));
                        images.due = true;
                        Ok((images.fences, len))
                    }
                }
            }
        };
        let protocol = c.protocol;
        match (protocol, sent) {
            (Protocol::Pmi1, Ok((fence, len))) => self.respond(task, |out| {
                Line::new(out, "kvs_image", rc::SUCCESS).int("bytes", len as i64).int("fence", fence as i64).finish()
            }),
            (Protocol::Pmi1, Err(why)) => {
                self.respond(task, |out| Line::new(out, "kvs_image", rc::FAIL).msg(why).finish())
            }
            (Protocol::Pmi2, Ok((fence, len))) => {
                self.answer_v2_with(task, "kvs-image-response", rc::SUCCESS, |f: Writer<'_>| {
                    f.str("bytes", len.to_string().as_bytes()).str("fence", fence.to_string().as_bytes())
                })
            }
            (Protocol::Pmi2, Err(why)) => self.answer_fail(task, "kvs-image-response", why),
        }
        if let Ok((fence, _)) = sent {
            self.clients[task].attached = Some(Attached::KvsImage(fence));
        }
    }
}
