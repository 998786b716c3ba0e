! tests/integration/block_client.c in Fortran: each rank holds a block of a 2-D or 3-D global array in an array
! with a halo of one cell, p(0:b1+1, 0:b2+1[, 0:b3+1]), and sends its interior, a section the compiler passes
! column-major, as its block of float32 field "p" (melissa_dl_init_block). The field has this code's axis order:
! at global index (i1, i2[, i3]), 0-based, step t of simulation s holds 10 s + 0.5 t + sum_d d 0.01 i_d.
!
!     block_client_f STEPS NDIM GLOBAL... DIMS...     e.g. block_client_f 3 3  7 6 5  2 2 2
program block_client_f
  use, intrinsic :: iso_fortran_env, only: real32, real64
  use mpi_f08
  use melissa_dl
  implicit none
  integer :: steps, ndim, rank, ierr, simulation, attempt, t, d, rest, parts, i, j, k
  integer :: whole(3), start(3), shape(3)
  character(32) :: arg
  real(real32), allocatable :: p(:, :, :)
  real(real64) :: value

  call MPI_Init()
  call MPI_Comm_rank(MPI_COMM_WORLD, rank)
  call get_command_argument(1, arg); read (arg, *) steps
  call get_command_argument(2, arg); read (arg, *) ndim
  whole = 1; start = 0; shape = 1
  rest = rank
  do d = ndim, 1, -1  ! the last axis varies fastest, as in the C and Python programs
    call get_command_argument(2 + d, arg); read (arg, *) whole(d)
    call get_command_argument(2 + ndim + d, arg); read (arg, *) parts
    i = mod(rest, parts)
    rest = rest / parts
    start(d) = i * (whole(d) / parts) + min(i, mod(whole(d), parts))
    shape(d) = whole(d) / parts + merge(1, 0, i < mod(whole(d), parts))
  end do
  allocate(p(0:shape(1) + 1, 0:shape(2) + 1, 0:shape(3) + 1))
  p = -1
  ierr = check(melissa_dl_simulation(simulation, attempt))
  if (ierr == MELISSA_DL_OK) ierr = check(melissa_dl_init_block("p", MELISSA_DL_FLOAT32, whole(1:ndim), &
                                                                  start(1:ndim), shape(1:ndim), MPI_COMM_WORLD))
  do t = 0, steps - 1
    if (ierr /= MELISSA_DL_OK) exit
    do k = 1, shape(3)
      do j = 1, shape(2)
        do i = 1, shape(1)
          value = 0.01_real64 * (start(1) + i - 1) + 2 * 0.01_real64 * (start(2) + j - 1)
          if (ndim == 3) value = value + 3 * 0.01_real64 * (start(3) + k - 1)
          p(i, j, k) = real(10.0_real64 * simulation + 0.5_real64 * t + value, real32)
        end do
      end do
    end do
    if (ndim == 2) then
      ierr = check(melissa_dl_send("p", t, p(1:shape(1), 1:shape(2), 1)))
    else
      ierr = check(melissa_dl_send("p", t, p(1:shape(1), 1:shape(2), 1:shape(3))))
    end if
  end do
  if (ierr == MELISSA_DL_OK) ierr = check(melissa_dl_finalize())
  call MPI_Finalize()
  if (ierr /= MELISSA_DL_OK) stop 1

contains

  integer function check(status)
    integer, intent(in) :: status
    check = status
    if (status /= MELISSA_DL_OK) write (0, '(a, i0, 2a)') "block_client_f: melissa_dl error ", status, ": ", &
                                       melissa_dl_error_message()
  end function

end program
