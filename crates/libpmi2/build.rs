//! The library's soname: programs link against `libpmi2.so.0`, as they do against Slurm's and Flux's.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libpmi2.so.0");
}
