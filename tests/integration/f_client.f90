! A Fortran simulation for the integration tests: the whole Fortran API.
!
! With `use mpi` communicators (integer handles; the heat solver uses
! mpi_f08), it prints the library version, its simulation, attempt and
! parameters, the parameter of each name given after the step count
! (`f_client STEPS [NAME ...]`: "parameter NAME: <value>") and the errors of
! three mistakes, then streams STEPS steps of the float64 field "field", a
! (3, 2) array per rank of value 1000 s + t + rank / 2.
program f_client
  use mpi
  use melissa_dl
  use, intrinsic :: iso_fortran_env, only: real64
  implicit none
  integer :: ierr, rank, protocol, simulation, attempt, t, steps, i
  character(16) :: argument
  character(64) :: name
  real(real64), allocatable :: parameters(:)
  real(real64) :: u(3, 2), value

  call get_command_argument(1, argument)
  read (argument, *) steps
  call MPI_Init(ierr)
  call MPI_Comm_rank(MPI_COMM_WORLD, rank, ierr)
  if (rank == 0) print '(3a, i0)', 'version: ', melissa_dl_version(protocol), ' protocol ', protocol
  call check(melissa_dl_simulation(simulation, attempt))
  call check(melissa_dl_parameters(parameters))
  if (rank == 0) print '(a, i0, a, i0)', 'simulation: ', simulation, ' attempt ', attempt
  if (rank == 0) print '(a, *(1x, es24.17))', 'parameters:', parameters
  do i = 2, command_argument_count()
    call get_command_argument(i, name)                   ! trailing blanks: the module drops them
    call check(melissa_dl_parameter(name, value))
    if (rank == 0) print '(3a, es24.17)', 'parameter ', trim(name), ':', value
  end do
  ierr = melissa_dl_parameter('x', value)
  if (rank == 0) print '(a, i0, 2a)', 'unknown parameter: ', ierr, ' ', melissa_dl_error_message()
  call check(melissa_dl_init('field   ', MELISSA_DL_FLOAT64, size(u), MPI_COMM_WORLD))
  ierr = melissa_dl_send('pressure', 0, u)
  if (rank == 0) print '(a, i0, 2a)', 'undeclared field: ', ierr, ' ', melissa_dl_error_message()
  ierr = melissa_dl_send('field', 0, u(1:2, :))
  if (rank == 0) print '(a, i0, 2a)', 'wrong count: ', ierr, ' ', melissa_dl_error_message()
  do t = 0, steps - 1
    u = 1000 * simulation + t + rank * 0.5_real64
    call check(melissa_dl_send('field', t, u))
  end do
  call check(melissa_dl_finalize())
  call MPI_Finalize(ierr)

contains

  subroutine check(status)
    integer, intent(in) :: status
    if (status /= MELISSA_DL_OK) then
      print '(a, i0, 2a)', 'f_client: melissa_dl error ', status, ': ', melissa_dl_error_message()
      call MPI_Abort(MPI_COMM_WORLD, 1, ierr)
    end if
  end subroutine

end program f_client
