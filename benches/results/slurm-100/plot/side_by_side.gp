set terminal pngcairo size 840,420 font ',9'
set output 'benches/results/slurm-100/side_by_side.png'
set multiplot layout 1,2
set logscale xy
set grid
set key top left
set datafile missing '?'
set xlabel 'N (tasks)'
set xtics (200, 400)
set title '(b) business cards'
set ylabel 'seconds'
plot 'benches/results/slurm-100/plot/b.dat' using 1:2:3:4 with yerrorlines title 'srun --mpi=rpmi', 'benches/results/slurm-100/plot/b.dat' using 1:5:6:7 with yerrorlines title 'srun --mpi=rpmi, star', 'benches/results/slurm-100/plot/b.dat' using 1:8:9:10 with yerrorlines title 'srun --mpi=pmi2'
set title '(c) 100 empty barriers'
set ylabel 'ms per barrier'
plot 'benches/results/slurm-100/plot/c.dat' using 1:2:3:4 with yerrorlines title 'srun --mpi=rpmi', 'benches/results/slurm-100/plot/c.dat' using 1:5:6:7 with yerrorlines title 'srun --mpi=rpmi, star', 'benches/results/slurm-100/plot/c.dat' using 1:8:9:10 with yerrorlines title 'srun --mpi=pmi2'
unset multiplot
