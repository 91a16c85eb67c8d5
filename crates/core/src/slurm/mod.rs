//! What the Slurm plugin's slurmstepds and srun say to each other, and how they prove they serve the same
//! step.

pub mod auth;
pub mod protocol;
