set terminal pngcairo size 1260,420 font ',9'
set output '/work/main/benches/results/side_by_side.png'
set multiplot layout 1,3
set logscale xy
set grid
set key top left
set datafile missing '?'
set xlabel 'N (tasks)'
set xtics (64, 256, 1024)
set title '(a) all-to-all'
set ylabel 'seconds'
plot '/work/main/benches/results/plot/a.dat' using 1:2:3:4 with yerrorlines title 'rpmi-run', '/work/main/benches/results/plot/a.dat' using 1:5:6:7 with yerrorlines title 'rpmi-run --nodes 4', '/work/main/benches/results/plot/a.dat' using 1:8:9:10 with yerrorlines title 'srun --mpi=rpmi', '/work/main/benches/results/plot/a.dat' using 1:11:12:13 with yerrorlines title 'mpiexec.hydra', '/work/main/benches/results/plot/a.dat' using 1:14:15:16 with yerrorlines title 'srun --mpi=pmi2', '/work/main/benches/results/plot/a.dat' using 1:17:18:19 with yerrorlines title 'floor'
set title '(b) business cards'
set ylabel 'seconds'
plot '/work/main/benches/results/plot/b.dat' using 1:2:3:4 with yerrorlines title 'rpmi-run', '/work/main/benches/results/plot/b.dat' using 1:5:6:7 with yerrorlines title 'rpmi-run --nodes 4', '/work/main/benches/results/plot/b.dat' using 1:8:9:10 with yerrorlines title 'srun --mpi=rpmi', '/work/main/benches/results/plot/b.dat' using 1:11:12:13 with yerrorlines title 'mpiexec.hydra', '/work/main/benches/results/plot/b.dat' using 1:14:15:16 with yerrorlines title 'srun --mpi=pmi2', '/work/main/benches/results/plot/b.dat' using 1:17:18:19 with yerrorlines title 'floor'
set title '(c) 1000 empty barriers'
set ylabel 'ms per barrier'
plot '/work/main/benches/results/plot/c.dat' using 1:2:3:4 with yerrorlines title 'rpmi-run', '/work/main/benches/results/plot/c.dat' using 1:5:6:7 with yerrorlines title 'rpmi-run --nodes 4', '/work/main/benches/results/plot/c.dat' using 1:8:9:10 with yerrorlines title 'srun --mpi=rpmi', '/work/main/benches/results/plot/c.dat' using 1:11:12:13 with yerrorlines title 'mpiexec.hydra', '/work/main/benches/results/plot/c.dat' using 1:14:15:16 with yerrorlines title 'srun --mpi=pmi2', '/work/main/benches/results/plot/c.dat' using 1:17:18:19 with yerrorlines title 'floor'
unset multiplot
