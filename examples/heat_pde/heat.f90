! The heat-equation simulation of heat.py, in Fortran with the melissa_dl module.
!
! The same scheme as solver.py (backward Euler solved exactly by fast
! diagonalisation in the sine basis, float64 arithmetic, float32 output; see
! its docstring), so that for the same parameters it sends the fields the
! Python solver computes, to rounding. Arrays are indexed like the Python
! ones, u(i, j) with i along x; each MPI rank owns the rows of
! split_rows(nx, size, rank) and sends them in row-major (C) order, as a 1-D
! slice of rows x ny elements that the server concatenates.
!
!     mpirun -n 2 heat_fortran [--nx 32] [--ny 32] [--steps 100] [--dt 0.001]
program heat
  use, intrinsic :: iso_fortran_env, only: real32, real64, error_unit
  use mpi_f08
  use melissa_dl
  implicit none

  real(real64), parameter :: pi = acos(-1.0_real64), alpha = 1.0_real64
  integer :: nx = 32, ny = 32, steps = 100, rank, ranks, start, stop, rows, t
  real(real64) :: dt = 1e-3_real64
  real(real64), allocatable :: p(:), sx(:, :), sy(:, :), mux(:), muy(:), mu(:, :), b(:, :), steady_hat(:, :), &
                               steady(:, :), w_hat(:, :), gain(:, :), sx_local(:, :), steady_local(:, :)
  real(real32), allocatable :: field(:, :)

  call parse_arguments()
  call MPI_Init()
  call MPI_Comm_rank(MPI_COMM_WORLD, rank)
  call MPI_Comm_size(MPI_COMM_WORLD, ranks)
  call split_rows(nx, ranks, rank, start, stop)
  rows = stop - start
  call check(melissa_dl_parameters(p))
  if (size(p) /= 5) then
    write (error_unit, '(a, i0)') 'heat_fortran: expected 5 parameters (initial, left, right, bottom, top), got ', &
      size(p)
    call MPI_Abort(MPI_COMM_WORLD, 1)
  end if
  call check(melissa_dl_init('temperature', MELISSA_DL_FLOAT32, rows * ny, MPI_COMM_WORLD))

  ! Sine bases and eigenvalues; the boundary source b of the interior system -A u = b.
  call sine_basis(nx, sx, mux)
  call sine_basis(ny, sy, muy)
  mu = spread(mux, 2, ny - 2) + spread(muy, 1, nx - 2)
  allocate(b(nx - 2, ny - 2))
  b = 0
  b(1, :) = b(1, :) + p(2) / real(nx - 1, real64)**(-2)
  b(nx - 2, :) = b(nx - 2, :) + p(3) / real(nx - 1, real64)**(-2)
  b(:, 1) = b(:, 1) + p(4) / real(ny - 1, real64)**(-2)
  b(:, ny - 2) = b(:, ny - 2) + p(5) / real(ny - 1, real64)**(-2)
  steady_hat = to_sine(b) / mu

  ! The steady state on the full grid; boundaries from the parameters, corners the mean of two edges.
  steady = matmul(matmul(sx, steady_hat), transpose(sy))
  steady(1, :) = p(2)
  steady(nx, :) = p(3)
  steady(:, 1) = p(4)
  steady(:, ny) = p(5)
  steady(1, 1) = (p(2) + p(4)) / 2
  steady(1, ny) = (p(2) + p(5)) / 2
  steady(nx, 1) = (p(3) + p(4)) / 2
  steady(nx, ny) = (p(3) + p(5)) / 2

  ! The deviation from the steady state, in the sine basis, decays by gain per step.
  b = p(1)
  w_hat = to_sine(b) - steady_hat
  gain = 1 / (1 + dt * alpha * mu)
  sx_local = sx(start + 1:stop, :)
  steady_local = steady(start + 1:stop, :)

  do t = 0, steps - 1
    w_hat = w_hat * gain
    field = real(transpose(steady_local + matmul(matmul(sx_local, w_hat), transpose(sy))), real32)  ! row-major
    call check(melissa_dl_send('temperature', t, field))
  end do
  call check(melissa_dl_finalize())
  call MPI_Finalize()

contains

  ! Rows [start, stop) (0-based) of n owned by rank among ranks ranks (solver.split_rows).
  subroutine split_rows(n, ranks, rank, start, stop)
    integer, intent(in) :: n, ranks, rank
    integer, intent(out) :: start, stop
    start = rank * (n / ranks) + min(rank, mod(n, ranks))
    stop = start + n / ranks + merge(1, 0, rank < mod(n, ranks))
  end subroutine

  ! The (n, n-2) sine basis of the 1-D Dirichlet Laplacian, zero on the boundary rows, and its eigenvalues.
  subroutine sine_basis(n, s, mu)
    integer, intent(in) :: n
    real(real64), allocatable, intent(out) :: s(:, :), mu(:)
    integer :: m, i, k
    real(real64) :: h
    m = n - 2
    h = 1.0_real64 / (n - 1)
    allocate(s(n, m), mu(m))
    s = 0
    do k = 1, m
      do i = 1, m
        s(i + 1, k) = sqrt(2.0_real64 / (m + 1)) * sin(pi * (i * k) / (m + 1))
      end do
      mu(k) = 4.0_real64 / h**2 * sin(pi * k / (2 * (m + 1)))**2
    end do
  end subroutine

  ! Sx_int^T @ u @ Sy_int for an interior array u.
  function to_sine(u) result(u_hat)
    real(real64), intent(in) :: u(:, :)
    real(real64), allocatable :: u_hat(:, :)
    u_hat = matmul(matmul(transpose(sx(2:nx - 1, :)), u), sy(2:ny - 1, :))
  end function

  ! The library never stops the program: the simulation decides, here by ending the whole MPI job.
  subroutine check(status)
    integer, intent(in) :: status
    if (status /= MELISSA_DL_OK) then
      write (error_unit, '(a, i0, 2a)') 'heat_fortran: melissa_dl error ', status, ': ', melissa_dl_error_message()
      call MPI_Abort(MPI_COMM_WORLD, 1)
    end if
  end subroutine

  subroutine parse_arguments()
    character(64) :: name, value
    integer :: i, status
    do i = 1, command_argument_count(), 2
      call get_command_argument(i, name)
      call get_command_argument(i + 1, value, status=status)
      if (status /= 0) call usage()
      select case (name)
      case ('--nx')
        read (value, *, iostat=status) nx
      case ('--ny')
        read (value, *, iostat=status) ny
      case ('--steps')
        read (value, *, iostat=status) steps
      case ('--dt')
        read (value, *, iostat=status) dt
      case default
        status = 1
      end select
      if (status /= 0) call usage()
    end do
    if (nx < 3 .or. ny < 3 .or. steps < 0 .or. .not. dt > 0) call usage()
  end subroutine

  subroutine usage()
    write (error_unit, '(a)') 'usage: heat_fortran [--nx N] [--ny N] [--steps N] [--dt DT]'
    stop 2
  end subroutine

end program heat
