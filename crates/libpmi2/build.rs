//! The library's soname: programs link against `libpmi2.so.0`, as they do against Slurm's and Flux's.

#[path = "../client/build/link.rs"]
mod link;

fn main() {
    link::client_library("libpmi2.so.0");
}
