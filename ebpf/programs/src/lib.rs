//! Host-side placeholder: the programs live in `main.rs` and are built for bpfel-unknown-none.
#![no_std]
