! A persistent worker in Fortran for the integration tests (tests/integration/test_native_workers.py), built with
! `mpifort f_worker.f90 $(pkg-config --cflags --libs melissa_dl_fortran)`: `f_worker STEPS [RECORD_DIR]`.
!
! On MPI_COMM_WORLD (mpi_f08), every rank prints "worker PID" once at its start, then, for each simulation
! melissa_dl_next hands it, "simulation S attempt A rank R parameters: P..." and streams STEPS steps of the
! float64 field "field", a (3, 2) array per rank of value 1000 S + t + R / 2; "over" once the study is.
! RECORD_DIR: every process also writes these lines to RECORD_DIR/workerPID.txt (as c_worker --record does).
program f_worker
  use mpi_f08
  use melissa_dl
  use, intrinsic :: iso_c_binding, only: c_int
  use, intrinsic :: iso_fortran_env, only: real64
  implicit none
  interface
    function process_id() bind(C, name="getpid") result(pid)
      import :: c_int
      integer(c_int) :: pid
    end function
  end interface
  integer :: ierr, rank, simulation, attempt, t, steps, record
  character(16) :: argument
  character(4096) :: record_dir, line
  logical :: more, recording = .false.
  real(real64), allocatable :: parameters(:)
  real(real64) :: u(3, 2)

  call get_command_argument(1, argument)
  read (argument, *) steps
  call MPI_Init(ierr)
  call MPI_Comm_rank(MPI_COMM_WORLD, rank, ierr)
  call get_command_argument(2, record_dir)
  if (len_trim(record_dir) > 0) then
    write (line, '(2a, i0, a)') trim(record_dir), '/worker', process_id(), '.txt'
    open (newunit=record, file=trim(line), position='append', action='write')
    recording = .true.
  end if
  write (line, '(a, i0)') 'worker ', process_id()
  call say(line)
  do
    call check(melissa_dl_next(MPI_COMM_WORLD, more))
    if (.not. more) exit
    call check(melissa_dl_simulation(simulation, attempt))
    call check(melissa_dl_parameters(parameters))
    write (line, '(a, i0, a, i0, a, i0, a, *(1x, es24.17))') 'simulation ', simulation, ' attempt ', attempt, &
      ' rank ', rank, ' parameters:', parameters
    call say(line)
    call check(melissa_dl_init('field', MELISSA_DL_FLOAT64, size(u), MPI_COMM_WORLD))
    do t = 0, steps - 1
      u = 1000 * simulation + t + rank * 0.5_real64
      call check(melissa_dl_send('field', t, u))
    end do
    call check(melissa_dl_finalize())
  end do
  call say('over')
  call MPI_Finalize(ierr)

contains

  ! print, and the same into the record file
  subroutine say(text)
    character(*), intent(in) :: text
    print '(a)', trim(text)
    flush (6)
    if (recording) then
      write (record, '(a)') trim(text)
      flush (record)
    end if
  end subroutine

  subroutine check(status)
    integer, intent(in) :: status
    if (status /= MELISSA_DL_OK) then
      print '(a, i0, 2a)', 'f_worker: melissa_dl error ', status, ': ', melissa_dl_error_message()
      call MPI_Abort(MPI_COMM_WORLD, 1, ierr)
    end if
  end subroutine

end program f_worker
