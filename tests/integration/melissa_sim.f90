! melissa_sim.c in Fortran, written to Melissa's Fortran API as Melissa documents it: the include file
! melissa_api.f90 beside `use mpi`, names terminated by C_NULL_CHAR (as Melissa asks) or not.
!
!     melissa_sim_f STEPS A B
program melissa_sim_f
  use mpi
  use, intrinsic :: iso_c_binding, only: c_null_char
  implicit none
  include "melissa_api.f90"
  integer, parameter :: global = 11
  integer :: steps, rank, size, first, local, t, i, ierr
  double precision :: a, b, u(global), mark(1)
  character(32) :: argument

  if (command_argument_count() /= 3) error stop "usage: melissa_sim_f STEPS A B"
  call get_command_argument(1, argument)
  read (argument, *) steps
  call get_command_argument(2, argument)
  read (argument, *) a
  call get_command_argument(3, argument)
  read (argument, *) b
  call MPI_Init(ierr)
  call MPI_Comm_rank(MPI_COMM_WORLD, rank, ierr)
  call MPI_Comm_size(MPI_COMM_WORLD, size, ierr)
  first = rank * global / size
  local = (rank + 1) * global / size - first
  call melissa_init("u" // c_null_char, local, MPI_COMM_WORLD)
  call melissa_init("mark", 1, MPI_COMM_WORLD)
  do t = 0, steps - 1
    u(:local) = [(a * (first + i) + b * t, i = 0, local - 1)]
    mark = 100 * rank + t
    call melissa_send("u" // c_null_char, u)
    call melissa_send("mark", mark)
  end do
  call melissa_finalize()
  call MPI_Finalize(ierr)
end program melissa_sim_f
